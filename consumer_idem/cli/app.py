"""The ``consumer-idem`` command group (typer + rich, from the ``cli`` extra).

Every command reads the ``CONSUMER_IDEM_*`` settings, accepts ``--dsn``/``--schema`` overrides,
prints for people by default and JSON with ``--json``, and ends with an exit code that tells
the truth (`ExitCode`): 0 done, 1 something was not settled,
2 bad input or an unreachable store or broker (one ``error:`` line on stderr), 130 interrupted.

The commands are module-level functions, one module per family: `.records` (migrate,
stats, list, inspect, evict), `.maintenance` (sweep, prune), `.recovery` (reconcile,
replay), on what `.common` shares; this module only assembles them.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from consumer_idem.cli import maintenance, records, recovery
from consumer_idem.cli.common import options


def build_app() -> Any:
    app = typer.Typer(
        help="Operate a consumer-idem store: migrate, list, inspect, sweep, prune, reconcile, "
        "replay. Exit codes: 0 done, 1 something was not settled, 2 bad input or unreachable "
        "service, 130 interrupted.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        verbose: Annotated[
            int,
            typer.Option("--verbose", "-v", count=True, help="-v: INFO logs, -vv: DEBUG"),
        ] = 0,
        progress_interval: Annotated[
            float,
            typer.Option(help="seconds between progress lines when stderr is not a terminal"),
        ] = 5.0,
    ) -> None:
        """Keeps `consumer-idem COMMAND` a command group."""
        options.verbose = verbose
        options.progress_interval = progress_interval

    app.command()(records.migrate)
    app.command()(records.stats)
    app.command("list")(records.list_keys)
    app.command()(records.inspect)
    app.command()(records.evict)
    app.command()(maintenance.sweep)
    app.command()(maintenance.prune)
    app.command()(recovery.reconcile)
    app.command()(recovery.replay)
    return app


app = build_app()
