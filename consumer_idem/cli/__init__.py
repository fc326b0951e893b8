"""``consumer-idem``: the operator's command line. Needs the ``cli`` extra (typer, rich)."""

import os
import sys


def main() -> None:
    # --handler/--resolver/--local-writes name the user's modules, as uvicorn's app does: the
    # current directory comes first on the path (a console script only has its own directory)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        from consumer_idem.cli.app import app
        from consumer_idem.cli.output import one_line
    except ImportError as exc:  # the extra is missing: say so in one line, no traceback
        sys.exit(
            f"consumer-idem: the CLI needs the 'cli' extra ({exc.name} is missing): "
            "pip install 'consumer-idem[cli]'"
        )
    try:
        code = app(standalone_mode=False)
    except Exception as exc:
        # click's exceptions, vendored by recent typer (typer._click) and not by older ones:
        # recognised by what they offer rather than by an import path
        name = type(exc).__name__
        if name == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]  # the help itself
            sys.exit(2)
        if name == "Abort":
            sys.stderr.write("error: aborted\n")
            sys.exit(1)
        message = getattr(exc, "format_message", None)
        if message is None:
            raise
        code = getattr(exc, "exit_code", 2)
        hint = " (see --help)" if code == 2 else ""  # a usage error
        sys.stderr.write(f"error: {one_line(message())}{hint}\n")  # bad arguments: one line
        sys.exit(code)
    sys.exit(code if isinstance(code, int) else 0)
