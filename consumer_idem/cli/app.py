"""The ``consumer-idem`` command group (typer + rich, from the ``cli`` extra).

Every command reads the ``CONSUMER_IDEM_*`` settings, accepts ``--dsn``/``--schema`` overrides,
prints for people by default and JSON with ``--json``, and exits 2 with one clear line when the
store or a broker cannot be reached, or a scope or key does not exist.
"""

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from enum import StrEnum
from typing import Annotated, Any, NoReturn, TypeVar

import asyncpg
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from consumer_idem.errors import StoreUnavailable
from consumer_idem.settings import Settings, load_settings
from consumer_idem.stores.postgres.store import PostgresStore, PrunePolicy

T = TypeVar("T")


class TransportName(StrEnum):
    kafka = "kafka"
    rabbit = "rabbit"


# Option types shared by every command (typer reads them from module globals).
DsnOpt = Annotated[
    str | None, typer.Option("--dsn", help="PostgreSQL DSN (default: CONSUMER_IDEM_PG_DSN)")
]
SchemaOpt = Annotated[
    str | None, typer.Option("--schema", help="store schema (default: CONSUMER_IDEM_SCHEMA)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
TransportOpt = Annotated[TransportName, typer.Option("--transport", help="kafka or rabbit")]

console = Console()
err = Console(stderr=True)


class CliError(Exception):
    """One line for the operator, exit code 2."""


def fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code=2)


def emit(data: Any, as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human()


@asynccontextmanager
async def open_store(dsn: str | None, schema: str | None) -> Any:
    settings = load_settings()
    try:
        pool = await asyncpg.create_pool(dsn or settings.pg_dsn, min_size=1, max_size=4, timeout=10)
    except Exception as exc:
        raise CliError(f"cannot connect to PostgreSQL: {type(exc).__name__}: {exc}") from exc
    assert pool is not None
    try:
        yield PostgresStore(pool, schema=schema or settings.schema_name)
    finally:
        await pool.close()


def run(main: Awaitable[T]) -> T:
    """Run a coroutine; store, broker and input problems become one line and exit 2."""
    try:
        return asyncio.run(main)  # type: ignore[arg-type]
    except (CliError, StoreUnavailable, ValueError, LookupError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot reach a service: {exc}")
    except Exception as exc:
        if type(exc).__module__.startswith(("aiokafka", "aiormq", "aio_pika")):
            fail(f"cannot reach the broker: {type(exc).__name__}: {exc}")
        raise


def store_call(
    dsn: str | None, schema: str | None, op: Callable[[PostgresStore], Awaitable[T]]
) -> T:
    async def main() -> T:
        async with open_store(dsn, schema) as store:
            return await op(store)

    return run(main())


async def known_scope(store: PostgresStore, scope: str) -> None:
    stats = await store.stats(scope)
    if not stats["scopes"]:
        raise CliError(f"unknown scope {scope!r}: no records in it")


def record_dict(record: Any) -> dict[str, Any]:
    out = {k: getattr(record, k) for k in record.__dataclass_fields__}
    out["result"] = record.result
    out.pop("result_json", None)
    if record.response is not None:
        out["response"] = {
            "status": record.response.status,
            "headers": dict(record.response.headers),
            "body_bytes": len(record.response.body),
        }
    return out


def transport_runner(
    transport: TransportName,
    processor: Any,
    settings: Settings,
    *,
    source: str,
    operator: str,
    group: str,
) -> Any:
    """A runner consuming ``source``; its dead letters go to ``operator``; it announces
    reconciliation notices to ``source`` (a reconciler consumes its own notices)."""
    if transport is TransportName.kafka:
        from consumer_idem.transports.kafka import KafkaRunner

        return KafkaRunner(
            processor,
            topics=[source],
            group_id=group,
            reconcile_topic=source,
            dead_letter_topic=operator,
        )
    from consumer_idem.transports.rabbit import RabbitRunner

    return RabbitRunner(processor, queue=source, reconcile_queue=source, dead_letter_queue=operator)


def build_app() -> Any:
    app = typer.Typer(
        help="Operate a consumer-idem store: migrate, inspect, sweep, prune, reconcile, replay.",
        no_args_is_help=True,
        add_completion=False,
    )

    @app.callback()
    def _root() -> None:
        """Keeps `consumer-idem COMMAND` a command group."""

    @app.command()
    def migrate(dsn: DsnOpt = None, schema: SchemaOpt = None, as_json: JsonOpt = False) -> None:
        """Create or upgrade the store's tables (safe to run from several processes at once)."""
        applied = store_call(dsn, schema, lambda s: s.migrate())
        emit(
            {"applied": applied},
            as_json,
            lambda: console.print(
                f"applied migrations: {', '.join(map(str, applied))}"
                if applied
                else "schema is up to date"
            ),
        )

    @app.command()
    def stats(
        scope: Annotated[str | None, typer.Option(help="only this scope")] = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Rows per status per scope, oldest in-progress and unknown ages, reconcile backlog."""

        async def op(store: PostgresStore) -> dict[str, Any]:
            if scope is not None:
                await known_scope(store, scope)
            return await store.stats(scope)

        data = store_call(dsn, schema, op)

        def human() -> None:
            statuses = ["in_progress", "completed", "failed_retryable", "unknown", "expired"]
            table = Table("scope", *statuses)
            for name, counts in data["scopes"].items():
                table.add_row(name, *(str(counts.get(s, 0)) for s in statuses))
            console.print(table)
            for label, value in (
                ("oldest in_progress", data["oldest_in_progress_s"]),
                ("oldest unknown", data["oldest_unknown_s"]),
            ):
                console.print(f"{label}: {'-' if value is None else f'{value:.0f} s'}")
            console.print(
                f"reconcile backlog (due): {data['reconcile_backlog']}, "
                f"with an operator: {data['with_operator']}"
            )

        emit(data, as_json, human)

    @app.command()
    def inspect(
        scope: str,
        key: str,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Show one record."""

        async def op(store: PostgresStore) -> Any:
            await known_scope(store, scope)
            record = await store.get(scope, key)
            if record is None:
                raise CliError(f"no record for key {key!r} in scope {scope!r}")
            return record

        record = store_call(dsn, schema, op)
        data = record_dict(record)

        def human() -> None:
            table = Table("field", "value", show_header=False)
            for k, v in data.items():
                table.add_row(k, escape(json.dumps(v, default=str)))
            console.print(table)

        emit(data, as_json, human)

    @app.command()
    def evict(
        scope: str,
        key: str,
        yes: Annotated[bool, typer.Option("--yes", help="do not ask for confirmation")] = False,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Delete one record: the key becomes new work. Asks first unless --yes."""
        if not yes and not typer.confirm(
            f"Evict ({scope}, {key})? A later delivery with this key will run again.",
            default=False,
        ):
            fail("not confirmed; nothing evicted")

        async def op(store: PostgresStore) -> bool:
            await known_scope(store, scope)
            return await store.evict(scope, key)

        deleted = store_call(dsn, schema, op)
        if not deleted:
            fail(f"no record for key {key!r} in scope {scope!r}")
        emit(
            {"evicted": True, "scope": scope, "key": key},
            as_json,
            lambda: console.print(f"evicted ({scope}, {key})"),
        )

    @app.command()
    def sweep(
        transport: Annotated[
            TransportName | None,
            typer.Option("--transport", help="publish due notices through kafka or rabbit"),
        ] = None,
        source: Annotated[
            str, typer.Option(help="reconciliation topic/queue")
        ] = "consumer_idem.reconcile",
        scope: Annotated[
            list[str] | None,
            typer.Option("--scope", help="only these scopes (repeatable; default: all)"),
        ] = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Once: park expired leases as unknown; with --transport, publish due notices."""
        from consumer_idem.operations.reconcile import (
            Reconciler,
            StillUnknown,
            Sweeper,
            SweepReport,
        )

        async def op(store: PostgresStore) -> dict[str, int]:
            if transport is None:
                zombies = await store.sweep()
                due = len(await store.due_notices(10_000, scope))
                return {"zombies": zombies, "published": 0, "due_unpublished": due}

            async def never(record: Any) -> StillUnknown:
                return StillUnknown()

            runner = transport_runner(
                transport,
                Reconciler(store, never),
                load_settings(),
                source=source,
                operator=f"{source}.operator",
                group="consumer-idem-sweep",
            )
            await runner.open_publisher()
            try:
                report: SweepReport = await Sweeper(store, runner, scopes=scope).run_once()
            finally:
                await runner.close_publisher()
            return {
                "zombies": report.zombies,
                "published": report.published,
                "redispatched": report.redispatched,
            }

        data = store_call(dsn, schema, op)
        emit(
            data,
            as_json,
            lambda: console.print(
                ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in data.items())
            ),
        )

    @app.command()
    def prune(
        policy: Annotated[
            PrunePolicy, typer.Option(help="delete, or soft-expire first")
        ] = PrunePolicy.DELETE,
        batch_size: Annotated[int, typer.Option(help="rows per statement")] = 1000,
        max_batches: Annotated[int | None, typer.Option(help="stop after this many")] = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Delete (or soft-expire) records past retention, in small batches."""

        async def op(store: PostgresStore) -> dict[str, Any]:
            await store.prune(policy=policy, batch_size=batch_size, max_batches=max_batches)
            r = store.last_prune
            return {
                "rows": r.rows,
                "batches": r.batches,
                "longest_statement_ms": round(r.longest_statement_s * 1000, 1),
            }

        data = store_call(dsn, schema, op)
        emit(
            data,
            as_json,
            lambda: console.print(
                f"pruned {data['rows']} rows in {data['batches']} batches "
                f"(longest statement {data['longest_statement_ms']} ms)"
            ),
        )

    @app.command()
    def reconcile(
        transport: TransportOpt,
        resolver: Annotated[str, typer.Option(help="module:function, async (record) -> answer")],
        source: Annotated[
            str, typer.Option(help="reconciliation topic/queue")
        ] = "consumer_idem.reconcile",
        operator: Annotated[
            str | None,
            typer.Option(help="operator dead-letter topic/queue (default SOURCE.operator)"),
        ] = None,
        group: Annotated[
            str, typer.Option(help="Kafka consumer group")
        ] = "consumer-idem-reconciler",
        scope: Annotated[
            list[str] | None,
            typer.Option("--scope", help="only these scopes (repeatable; default: all)"),
        ] = None,
        max_attempts: Annotated[int, typer.Option()] = 8,
        max_age_hours: Annotated[float, typer.Option()] = 48.0,
        sweep_interval: Annotated[float, typer.Option(help="seconds between sweeps")] = 5.0,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
    ) -> None:
        """Run the reconciler and its sweeper until SIGTERM/SIGINT."""
        from consumer_idem.operations.reconcile import Reconciler, Sweeper
        from consumer_idem.operations.replay import load_target

        async def main() -> None:
            async with open_store(dsn, schema) as store:
                answer = load_target(resolver)
                reconciler = Reconciler(
                    store,
                    answer,
                    max_attempts=max_attempts,
                    max_age=timedelta(hours=max_age_hours),
                    scopes=scope,
                )
                runner = transport_runner(
                    transport,
                    reconciler,
                    load_settings(),
                    source=source,
                    operator=operator or f"{source}.operator",
                    group=group,
                )
                reconciler.attach(runner)
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                await runner.start()
                console.print(f"reconciling {source} via {transport.value}; Ctrl-C to stop")
                sweeper = asyncio.create_task(
                    Sweeper(store, runner, scopes=scope).run(stop, sweep_interval)
                )

                await runner.run(stop)
                await sweeper
                console.print(json.dumps(runner.stats.__dict__))

        run(main())

    @app.command()
    def replay(
        transport: TransportOpt,
        source: Annotated[str, typer.Option(help="dead-letter topic/queue to replay")],
        handler: Annotated[
            str,
            typer.Option(
                help="module:function giving the IdempotentConsumer (or taking the store)"
            ),
        ],
        group: Annotated[
            str | None,
            typer.Option(
                help="Kafka group of this replay (resumable); default consumer-idem-replay.SOURCE"
            ),
        ] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="only count")] = False,
        rate: Annotated[float | None, typer.Option(help="messages per second at most")] = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Run a dead-letter topic/queue through the idempotent handler: completed keys are
        skipped, unknown ones reported, the rest run once."""
        from consumer_idem.operations import replay as replaying

        settings = load_settings()

        async def main() -> replaying.ReplayReport:
            async with open_store(dsn, schema) as store:
                consumer = replaying.load_consumer(handler, store)
                if transport is TransportName.kafka:
                    messages = replaying.kafka_source(
                        source,
                        group_id=group or f"consumer-idem-replay.{source}",
                        bootstrap_servers=settings.kafka_bootstrap,
                        commit=not dry_run,
                    )
                else:
                    messages = replaying.rabbit_source(
                        source, url=settings.amqp_url, requeue_all=dry_run
                    )
                with Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.fields[counts]}"),
                    TimeElapsedColumn(),
                    console=err,
                    disable=as_json,
                ) as progress:
                    task = progress.add_task(
                        "replay" if not dry_run else "dry run", total=None, counts=""
                    )

                    def show(report: replaying.ReplayReport) -> None:
                        counts = " ".join(
                            f"{k}={v}" for k, v in replaying.report_row(report).items()
                        )
                        progress.update(task, counts=counts)

                    return await replaying.replay(
                        consumer, messages, dry_run=dry_run, rate=rate, on_progress=show
                    )

        report = run(main())
        data = {"dry_run": dry_run, **report.as_dict()}
        emit(
            data,
            as_json,
            lambda: console.print(
                ("would: " if dry_run else "")
                + ", ".join(f"{k} {v}" for k, v in replaying.report_row(report).items())
            ),
        )

    return app


app = build_app()
