"""``consumer-idem``: the operator's command line. Needs the ``cli`` extra (typer, rich)."""

import sys


def main() -> None:
    try:
        from consumer_idem.cli.app import app
    except ImportError as exc:  # the extra is missing: say so in one line, no traceback
        sys.exit(
            f"consumer-idem: the CLI needs the 'cli' extra ({exc.name} is missing): "
            "pip install 'consumer-idem[cli]'"
        )
    app()
