"""The ``consumer-idem`` command group (typer + rich, from the ``cli`` extra).

Every command reads the ``CONSUMER_IDEM_*`` settings, accepts ``--dsn``/``--schema`` overrides,
prints for people by default and JSON with ``--json``, and exits non-zero with one clear line
when the store cannot be reached.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import asyncpg
import typer
from rich.console import Console
from rich.markup import escape

from consumer_idem.errors import StoreUnavailable
from consumer_idem.settings import load_settings
from consumer_idem.store import PostgresStore

T = TypeVar("T")

# Option types shared by every command (typer reads them from module globals).
DsnOpt = Annotated[
    str | None, typer.Option("--dsn", help="PostgreSQL DSN (default: CONSUMER_IDEM_PG_DSN)")
]
SchemaOpt = Annotated[
    str | None, typer.Option("--schema", help="store schema (default: CONSUMER_IDEM_SCHEMA)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _store_call(
    dsn: str | None, schema: str | None, op: Callable[[PostgresStore], Awaitable[T]]
) -> T:
    settings = load_settings()

    async def run() -> T:
        try:
            pool = await asyncpg.create_pool(
                dsn or settings.pg_dsn, min_size=1, max_size=2, timeout=10
            )
        except Exception as exc:
            raise StoreUnavailable(
                f"cannot connect to PostgreSQL: {type(exc).__name__}: {exc}"
            ) from exc
        assert pool is not None
        try:
            return await op(PostgresStore(pool, schema=schema or settings.schema_name))
        finally:
            await pool.close()

    return asyncio.run(run())


def build_app() -> Any:
    app = typer.Typer(
        help="Operate a consumer-idem store: migrate, inspect, sweep, prune, reconcile, replay.",
        no_args_is_help=True,
        add_completion=False,
    )
    console = Console()
    err = Console(stderr=True)

    @app.callback()
    def _root() -> None:
        """Keeps `consumer-idem COMMAND` a command group even while it has few commands."""

    def fail(message: str) -> None:
        err.print(f"[bold red]error:[/] {escape(message)}")
        raise typer.Exit(code=2)

    @app.command()
    def migrate(dsn: DsnOpt = None, schema: SchemaOpt = None, as_json: JsonOpt = False) -> None:
        """Create or upgrade the store's tables (safe to run from several processes at once)."""
        try:
            applied = _store_call(dsn, schema, lambda s: s.migrate())
        except (StoreUnavailable, ValueError) as exc:
            fail(str(exc))
        if as_json:
            print(json.dumps({"applied": applied}))
        elif applied:
            console.print(f"applied migrations: {', '.join(map(str, applied))}")
        else:
            console.print("schema is up to date")

    return app


app = build_app()
