"""The ``consumer-idem`` command group (typer + rich, from the ``cli`` extra).

Every command reads the ``CONSUMER_IDEM_*`` settings, accepts ``--dsn``/``--schema`` overrides,
prints for people by default and JSON with ``--json``, and ends with an exit code that tells
the truth (:class:`~consumer_idem.cli.output.ExitCode`): 0 done, 1 something was not settled,
2 bad input or an unreachable store or broker (one ``error:`` line on stderr), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape
from rich.table import Table

from consumer_idem.cli.brokers import AmqpUrlOpt, BootstrapOpt, broker_settings
from consumer_idem.cli.output import (
    CliError,
    ExitCode,
    Reporter,
    age,
    console,
    evict_consequence,
    evicted_line,
    fail,
    held_line,
    note,
    parse_duration,
    setup_logging,
    store_errors_fatal,
)
from consumer_idem.cli.settings import Settings, load_settings
from consumer_idem.errors import ConsumerIdemError, SchemaMissing
from consumer_idem.stores.postgres.maintenance import (
    DEFAULT_PRUNE_RATE,
    KeyInfo,
    KeyPage,
    PrunePolicy,
    PruneReport,
    StoreStats,
)
from consumer_idem.stores.postgres.outbox import OutboxStats
from consumer_idem.stores.postgres.pooler import create_pool
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Eviction, Record, Status

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
ScopesOpt = Annotated[
    list[str] | None,
    typer.Option("--scope", help="only these scopes (repeatable; default: all)"),
]

STATUSES = [s.value for s in Status]


@dataclass
class _Options:
    """The group's own options (``consumer-idem -v COMMAND``)."""

    verbose: int = 0
    progress_interval: float = 5.0


options = _Options()


def emit(data: Any, as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        print(json.dumps(data, default=str, ensure_ascii=False))
    else:
        human()


def migrate_hint(schema: str | None, dsn: str | None) -> str:
    flags = (f" --schema {schema}" if schema else "") + (" --dsn ..." if dsn else "")
    return f"run `consumer-idem migrate{flags}`"


@asynccontextmanager
async def open_store(
    dsn: str | None, schema: str | None, *, check: bool = True
) -> AsyncIterator[PostgresStore]:
    """The store, on a small pool; with ``check``, refusing a missing or outdated schema with
    the command that fixes it."""
    settings = load_settings()
    store_schema = schema or settings.schema_name
    try:
        pool = await create_pool(
            dsn or settings.pg_dsn,
            pooler=settings.pg_pooler,
            min_size=1,
            max_size=4,
            timeout=10,
        )
    except Exception as exc:
        raise CliError(f"cannot connect to PostgreSQL: {type(exc).__name__}: {exc}") from exc
    assert pool is not None
    try:
        store = PostgresStore(pool, schema=store_schema, pooler=settings.pg_pooler)
        if check:
            try:
                with store_errors_fatal():
                    await store.check_schema()
            except SchemaMissing as exc:
                cause = exc.__cause__
                what = (
                    f"the idempotency schema {store_schema!r} is missing or outdated "
                    f"({type(cause).__name__}: {cause})"
                    if cause
                    else str(exc).split(": run")[0]  # "... is at version N, this library needs M"
                )
                raise CliError(f"{what}: {migrate_hint(schema, dsn)}") from exc
        yield store
    finally:
        await pool.close()


def run(
    main: Coroutine[Any, Any, T], *, one_shot: bool = True, default: int = logging.WARNING
) -> T:
    """Run a command's coroutine. Store, broker and input problems become one ``error:`` line
    and exit 2; an interrupt, exit 130. ``one_shot``: any store failure ends the command (so
    the store's own warning about it is not printed as well)."""
    setup_logging(options.verbose, default=default)
    try:
        if one_shot:
            with store_errors_fatal():
                return asyncio.run(main)
        return asyncio.run(main)
    except (CliError, ConsumerIdemError, ValueError, LookupError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot reach a service: {exc}")
    except KeyboardInterrupt:
        fail("interrupted", ExitCode.INTERRUPTED)
    except Exception as exc:
        if type(exc).__module__.startswith(("aiokafka", "aiormq", "aio_pika", "pamqp")):
            fail(f"cannot reach the broker: {type(exc).__name__}: {exc}")
        raise


def store_call(
    dsn: str | None, schema: str | None, op: Callable[[PostgresStore], Awaitable[T]]
) -> T:
    async def main() -> T:
        async with open_store(dsn, schema) as store:
            return await op(store)

    return run(main())


def on_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop`` (the command ends after the item in hand); a second Ctrl-C
    interrupts at once."""
    loop = asyncio.get_running_loop()

    def first(sig: signal.Signals) -> None:
        stop.set()
        if sig is signal.SIGINT:
            loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C: KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first, sig)


def finish(code: ExitCode) -> None:
    if code is not ExitCode.OK:
        raise typer.Exit(code=int(code))


async def known_scope(store: PostgresStore, scope: str) -> None:
    stats = await store.maintenance.stats(scope)
    if not stats.scopes:
        raise CliError(f"unknown scope {scope!r}: no records in it")


async def known_record(store: PostgresStore, scope: str, key: str) -> Record:
    """The key's record, or a clear error naming an unknown scope or key."""
    await known_scope(store, scope)
    record = await store.get(scope, key)
    if record is None:
        raise CliError(f"no record for key {key!r} in scope {scope!r}")
    return record


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
            bootstrap_servers=settings.kafka_bootstrap,
            reconcile_topic=source,
            dead_letter_topic=operator,
        )
    from consumer_idem.transports.rabbit import RabbitRunner

    return RabbitRunner(
        processor,
        queue=source,
        reconcile_queue=source,
        dead_letter_queue=operator,
        url=settings.amqp_url,
    )


def plural(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def folding_table(*columns: str) -> Table:
    """A table whose cells fold instead of being cut: no scope or key is ever truncated."""
    table = Table()
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def key_row(info: KeyInfo) -> list[str]:
    status = info.status.value
    if info.status is Status.UNKNOWN and info.reconcile_after is None:
        status += " (operator)"
    if info.lease_left_s is not None:
        left = info.lease_left_s
        lease = f"{age(left)} left" if left >= 0 else f"expired {age(-left)} ago"
        status += f" (lease {lease})"
    return [
        escape(info.scope),
        escape(info.key),
        status,
        str(info.attempts),
        age(info.age_s),
        escape(info.last_error or ""),
    ]


def stats_table(data: StoreStats) -> None:
    table = folding_table("scope", *STATUSES)
    for s in data.scopes:
        table.add_row(escape(s.scope), *(str(s.count(status)) for status in STATUSES))
    console.print(table)
    console.print(
        f"oldest in_progress: {age(data.oldest_in_progress_s)}, "
        f"oldest unknown: {age(data.oldest_unknown_s)}"
    )
    console.print(
        f"reconcile backlog (due): {data.reconcile_backlog}, with an operator: {data.with_operator}"
    )


def outbox_lines(outbox: OutboxStats) -> None:
    """The transactional outbox: depth and age, and what waits for an operator."""
    console.print(
        f"outbox: {outbox.pending} pending (oldest {age(outbox.oldest_pending_s)}), "
        f"{outbox.parked} parked (refused for good: an operator's)"
    )


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

    @app.command()
    def migrate(dsn: DsnOpt = None, schema: SchemaOpt = None, as_json: JsonOpt = False) -> None:
        """Create or upgrade the store's tables (safe to run from several processes at once)."""

        async def main() -> list[int]:
            async with open_store(dsn, schema, check=False) as store:
                return await store.migrate()

        applied = run(main())
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
        """Rows per status per scope, oldest in-progress and unknown ages, reconcile backlog,
        and the outbox: pending messages (depth, oldest age) and parked ones."""

        async def op(store: PostgresStore) -> tuple[StoreStats, OutboxStats]:
            if scope is not None:
                await known_scope(store, scope)
            return await store.maintenance.stats(scope), await store.outbox.stats(scope)

        data, outbox = store_call(dsn, schema, op)

        def human() -> None:
            stats_table(data)
            outbox_lines(outbox)

        emit({**data.as_dict(), "outbox": outbox.as_dict()}, as_json, human)

    @app.command("list")
    def list_keys(
        status: Annotated[
            list[Status] | None,
            typer.Option("--status", help="only this status (repeatable)"),
        ] = None,
        scope: Annotated[
            str | None, typer.Option("--scope", help="only scopes starting with this")
        ] = None,
        older_than: Annotated[
            timedelta | None,
            typer.Option(
                parser=parse_duration,
                metavar="DURATION",
                help="last written longer ago than this (90s, 15m, 1h30m, 2d)",
            ),
        ] = None,
        limit: Annotated[int, typer.Option(min=1, max=10_000, help="keys per page")] = 50,
        after: Annotated[
            str | None, typer.Option(help="the cursor a previous page printed: its next page")
        ] = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Keys oldest first (by last write), filtered by status, scope prefix and age.

        A page ends with the `--after` cursor of the next one; with --json, one object per line,
        each with its own `cursor`."""
        page: KeyPage = store_call(
            dsn,
            schema,
            lambda store: store.maintenance.list_keys(
                statuses=status,
                scope_prefix=scope,
                older_than=older_than,
                limit=limit,
                after=after,
            ),
        )
        again = " ".join(
            ["consumer-idem list"]
            + [f"--status {s.value}" for s in status or ()]
            + ([f"--scope {scope}"] if scope else [])
            + ([f"--older-than {older_than.total_seconds():g}s"] if older_than else [])
            + ([f"--limit {limit}"] if limit != 50 else [])
            + (["--json"] if as_json else [])
        )
        if as_json:
            for info in page.keys:
                print(json.dumps(info.as_dict(), default=str, ensure_ascii=False))
            if page.next_cursor:
                note(f"next page: {again} --after {page.next_cursor}")
            return
        if not page.keys:
            note("no keys match")
            return
        table = folding_table("scope", "key", "status", "attempts", "age", "last error")
        for info in page.keys:
            table.add_row(*key_row(info))
        console.print(table)
        if page.next_cursor:
            console.print(f"next page: {escape(again)} --after {page.next_cursor}", soft_wrap=True)

    @app.command()
    def inspect(
        scope: str,
        key: str,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Show one record."""

        record = store_call(dsn, schema, lambda store: known_record(store, scope, key))
        data = record_dict(record)

        def human() -> None:
            table = Table("field", "value", show_header=False)
            table.columns[1].overflow = "fold"
            for k, v in data.items():
                table.add_row(k, escape(json.dumps(v, default=str, ensure_ascii=False)))
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
        """Delete one record: the key becomes new work and runs again. Asks first unless --yes.

        An unknown or failed_retryable key whose delivery was acked is not lost: its kept
        original message is armed in the same transaction, and the sweeper (`sweep
        --transport`, or a running reconciler's) sends it again to its topic or queue. Evicting
        an unknown key says it did not take effect: if it may have, reconcile it instead. A key
        a worker holds (in_progress, lease running) is not evicted: wait for it."""

        if not yes:
            record = store_call(dsn, schema, lambda store: known_record(store, scope, key))
            held = record.locked_until if record.status is Status.IN_PROGRESS else None
            if held is not None and held > datetime.now(UTC):  # the DELETE checks it again
                fail(held_line(Eviction(scope, key, record.status, held_until=held)))
            question = f"Evict ({scope}, {key})? {evict_consequence(record.status)}"
            if not typer.confirm(question, err=True):  # stdout holds the answer (--json)
                fail("not confirmed; nothing evicted")

        async def op(store: PostgresStore) -> Eviction | None:
            await known_scope(store, scope)
            return await store.evict_record(scope, key)

        eviction = store_call(dsn, schema, op)
        if eviction is None:
            fail(f"no record for key {key!r} in scope {scope!r}")
        if not eviction.evicted:
            fail(held_line(eviction))
        emit(
            {
                "evicted": True,
                "scope": scope,
                "key": key,
                "status": eviction.status.value,
                "redispatch_to": eviction.redispatch_to,
            },
            as_json,
            lambda: console.print(evicted_line(eviction), soft_wrap=True),
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
        scope: ScopesOpt = None,
        bootstrap_servers: BootstrapOpt = None,
        amqp_url: AmqpUrlOpt = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Once: park expired leases as unknown (every scope); with --transport, also publish
        due notices and send due re-dispatches (of --scope, default all). Exit 1 when a notice
        or re-dispatch could not be sent (they stay due)."""
        from consumer_idem.operations.reconcile import Reconciler, StillUnknown, Sweeper

        reporter = Reporter("sweep", interval=options.progress_interval)

        async def main() -> dict[str, int]:
            async with open_store(dsn, schema) as store:
                stop = asyncio.Event()
                on_signals(stop)
                if transport is None:
                    total = await store.maintenance.count_expired_leases()
                    with reporter.running():
                        reporter.update(0, total, "")
                        swept = await store.maintenance.sweep(
                            on_batch=lambda r: reporter.update(
                                r.parked, max(total, r.parked), f"parked {r.parked}"
                            ),
                            stop=stop,
                        )
                    due = len(await store.reconciliation.due_notices(10_000, scope))
                    return {"zombies": swept.parked, "due_unpublished": due}

                async def never(record: Any) -> StillUnknown:
                    return StillUnknown()

                runner = transport_runner(
                    transport,
                    Reconciler(store, never),
                    broker_settings(bootstrap_servers, amqp_url),
                    source=source,
                    operator=f"{source}.operator",
                    group="consumer-idem-sweep",
                )
                await runner.open_publisher()
                try:
                    with reporter.running():
                        reporter.update(0, None, "parking, publishing, re-dispatching")
                        report = await Sweeper(store, runner, scopes=scope).run_once()
                finally:
                    await runner.close_publisher()
                return asdict(report)

        data = run(main(), one_shot=transport is None)
        failures = data.get("refused", 0) + data.get("redispatch_failed", 0)

        def human() -> None:
            line = f"parked {plural(data['zombies'], 'expired lease')} as unknown"
            if transport is None:
                due = data["due_unpublished"]
                line += f"; {plural(due, 'reconciliation notice')} due and unpublished" + (
                    " (a reconciler publishes them, or sweep --transport)" if due else ""
                )
            else:
                line += (
                    f"; published {plural(data['published'], 'due notice')}"
                    f" ({data['refused']} refused, still due);"
                    f" re-dispatched {plural(data['redispatched'], 'original')}"
                    f" ({data['redispatch_failed']} failed, retried later)"
                )
            console.print(line)

        emit(data, as_json, human)
        finish(ExitCode.PARTIAL if failures else ExitCode.OK)

    @app.command()
    def prune(
        policy: Annotated[
            PrunePolicy, typer.Option(help="delete, or soft-expire first")
        ] = PrunePolicy.DELETE,
        batch_size: Annotated[int, typer.Option(min=1, help="rows per statement")] = 200,
        max_batches: Annotated[int | None, typer.Option(min=1, help="stop after this many")] = None,
        max_rows_per_s: Annotated[
            float,
            typer.Option(min=0, help="pace: rows a second at most (0: as fast as it goes)"),
        ] = DEFAULT_PRUNE_RATE,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Delete (or soft-expire) records past retention, in small batches, paced so that
        live traffic beside it keeps its speed."""
        if not math.isfinite(max_rows_per_s):  # inf would be no pace at all: 0 says so
            raise typer.BadParameter(
                "a finite number of rows a second, or 0 for no pace",
                param_hint="'--max-rows-per-s'",
            )
        reporter = Reporter(f"prune ({policy.value})", interval=options.progress_interval)
        interrupted = False

        async def main() -> PruneReport:
            nonlocal interrupted
            async with open_store(dsn, schema) as store:
                stop = asyncio.Event()
                on_signals(stop)
                total = await store.maintenance.count_prunable()
                with reporter.running():
                    reporter.update(0, total, "")
                    report = await store.maintenance.prune(
                        policy=policy,
                        batch_size=batch_size,
                        max_batches=max_batches,
                        on_batch=lambda r: reporter.update(
                            r.rows, max(total, r.rows), f"{r.batches} batches"
                        ),
                        stop=stop,
                        max_rows_per_s=max_rows_per_s,
                    )
                interrupted = stop.is_set() and not report.finished
                return report

        report = run(main())
        data = {
            **asdict(report),
            "longest_statement_ms": round(report.longest_statement_s * 1000, 1),
            "interrupted": interrupted,
        }
        done = "deleted" if policy is PrunePolicy.DELETE else "soft-expired or deleted"

        def human() -> None:
            console.print(
                f"{done} {report.rows} rows past retention in {report.batches} batches "
                f"(longest statement {data['longest_statement_ms']} ms)"
                + ("" if report.finished else "; stopped early, more rows may be due")
            )

        emit(data, as_json, human)
        finish(ExitCode.INTERRUPTED if interrupted else ExitCode.OK)

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
        scope: ScopesOpt = None,
        max_attempts: Annotated[int, typer.Option()] = 8,
        max_age_hours: Annotated[float, typer.Option()] = 48.0,
        sweep_interval: Annotated[float, typer.Option(help="seconds between sweeps")] = 5.0,
        local_writes: Annotated[
            list[str] | None,
            typer.Option(
                "--local-writes",
                help="SCOPE=module:function: the two-phase local_writes an 'executed' answer "
                "commits with the resolution (repeatable)",
            ),
        ] = None,
        bootstrap_servers: BootstrapOpt = None,
        amqp_url: AmqpUrlOpt = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Run the reconciler and its sweeper until SIGTERM/SIGINT, then print what it did.
        Logs every state change (INFO). Exit 1 when a case went to the operator or a notice
        was invalid."""
        from consumer_idem.operations.reconcile import NEEDS_OPERATOR, OUTCOMES, Reconciler
        from consumer_idem.operations.reconcile import Sweeper as SweeperType
        from consumer_idem.operations.replay import load_target

        reporter = Reporter("reconcile", interval=options.progress_interval)

        async def main() -> dict[str, Any]:
            async with open_store(dsn, schema) as store:
                answer = load_target(resolver)
                writes = {}
                for spec in local_writes or []:
                    name, sep, target = spec.partition("=")
                    if not sep or not name:
                        raise ValueError(
                            f"--local-writes wants SCOPE=module:function, not {spec!r}"
                        )
                    writes[name] = load_target(target)
                reconciler = Reconciler(
                    store,
                    answer,
                    max_attempts=max_attempts,
                    max_age=timedelta(hours=max_age_hours),
                    scopes=scope,
                    local_writes=writes,
                )
                runner = transport_runner(
                    transport,
                    reconciler,
                    broker_settings(bootstrap_servers, amqp_url),
                    source=source,
                    operator=operator or f"{source}.operator",
                    group=group,
                )
                reconciler.attach(runner)
                stop = asyncio.Event()
                on_signals(stop)
                await runner.start()
                note(f"reconciling {source} via {transport.value}; Ctrl-C to stop")
                sweeper = SweeperType(store, runner, scopes=scope)
                sweeping = asyncio.create_task(sweeper.run(stop, sweep_interval))
                with reporter.running():
                    showing = asyncio.create_task(
                        _show_reconcile(store, reconciler, sweeper, reporter, stop, scope)
                    )
                    try:
                        await runner.run(stop)
                        await sweeping
                    finally:
                        stop.set()
                        await showing
                left = await store.maintenance.count_unknown(scope)
                scheduled = await store.maintenance.count_unknown(scope, scheduled_only=True)
                tally = {reason: reconciler.tally.get(reason, 0) for reason in OUTCOMES}
                return {
                    "outcomes": tally,
                    "sweeps": asdict(sweeper.total),
                    "unknown_left": left,
                    "with_operator": left - scheduled,
                    "needs_operator": sum(tally[r] for r in NEEDS_OPERATOR),
                }

        data = run(main(), one_shot=False, default=logging.INFO)

        def human() -> None:
            done = [f"{n} {OUTCOMES[r]}" for r, n in data["outcomes"].items() if n]
            console.print(f"notices handled: {', '.join(done) if done else 'none'}")
            sweeps = data["sweeps"]
            console.print(
                f"sweeps: {sweeps['zombies']} expired leases parked as unknown, "
                f"{sweeps['published']} notices published ({sweeps['refused']} refused), "
                f"{sweeps['redispatched']} originals re-dispatched "
                f"({sweeps['redispatch_failed']} failed)"
            )
            console.print(
                f"unknown left: {data['unknown_left']} ({data['with_operator']} with an operator)"
            )

        emit(data, as_json, human)
        failures = data["needs_operator"] + data["sweeps"]["refused"]
        finish(ExitCode.PARTIAL if failures else ExitCode.OK)

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
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="only count: change and log nothing")
        ] = False,
        rate: Annotated[float | None, typer.Option(help="messages per second at most")] = None,
        bootstrap_servers: BootstrapOpt = None,
        amqp_url: AmqpUrlOpt = None,
        dsn: DsnOpt = None,
        schema: SchemaOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Run a dead-letter topic/queue through the idempotent handler: completed keys are
        skipped, unknown ones left to reconciliation, the rest run once. What it cannot settle
        is dead-lettered again to SOURCE with the reason (a re-run meets it again) and listed;
        exit 1 then, 130 if interrupted (a re-run resumes)."""
        from consumer_idem.operations import replay as replaying

        settings = broker_settings(bootstrap_servers, amqp_url)
        reporter = Reporter("dry run" if dry_run else "replay", interval=options.progress_interval)

        def show(report: replaying.ReplayReport) -> None:
            counts = " ".join(f"{k}={v}" for k, v in replaying.report_row(report).items())
            reporter.update(report.read, report.total, counts)

        async def main() -> replaying.ReplayReport:
            async with open_store(dsn, schema) as store:
                try:
                    consumer = replaying.load_consumer(handler, store)
                except TypeError as exc:
                    raise CliError(str(exc)) from exc
                messages: Any
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
                stop = asyncio.Event()
                on_signals(stop)
                with reporter.running():
                    return await replaying.replay(
                        consumer, messages, dry_run=dry_run, rate=rate, on_progress=show, stop=stop
                    )

        report = run(main(), one_shot=False)
        data = {"dry_run": dry_run, "source": source, **report.as_dict()}
        emit(data, as_json, lambda: _replay_summary(report, dry_run, source))
        if report.interrupted:
            finish(ExitCode.INTERRUPTED)
        finish(ExitCode.PARTIAL if report.unsettled and not dry_run else ExitCode.OK)

    return app


async def _show_reconcile(
    store: PostgresStore,
    reconciler: Any,
    sweeper: Any,
    reporter: Reporter,
    stop: asyncio.Event,
    scopes: list[str] | None,
) -> None:
    """Keep the reconcile progress current: cases this run settled (or handed to the operator)
    against those plus the ones reconciliation still has, re-counted when the tally moves and
    every few seconds otherwise."""
    loop = asyncio.get_running_loop()
    left: int | None = None
    counted_at = -1e9
    counted_for = -1
    while True:
        tally = reconciler.tally
        operator = tally["reconcile_exhausted"] + tally["redispatch_exhausted"]
        done = tally["executed"] + tally["not_executed"] + operator
        if done != counted_for or loop.time() - counted_at >= 5.0:
            with suppress(ConsumerIdemError):  # a store blip: keep the last count
                left = await store.maintenance.count_unknown(scopes, scheduled_only=True)
            counted_at, counted_for = loop.time(), done
        counts = (
            f"executed {tally['executed']}, not executed {tally['not_executed']}, "
            f"still unknown {tally['rescheduled']}, to operator {operator}, "
            f"zombies {sweeper.total.zombies}"
        )
        reporter.update(done, None if left is None else done + left, counts)
        if stop.is_set():
            return
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)


#: how a replay's categories read in its summary (dry run, real run)
_REPLAY_WORDS = {
    "execute": ("would execute", "executed"),
    "skip": ("already completed (would be skipped)", "already completed (skipped)"),
    "unknown": ("parked unknown (left to reconciliation)",) * 2,
    "in_progress": ("held by a live worker",) * 2,
    "misuse": ("key reused with another payload",) * 2,
    "invalid": ("without a valid key or body",) * 2,
    "failed": ("-", "failed again"),
}


def _replay_summary(report: Any, dry_run: bool, source: str) -> None:
    from consumer_idem.operations.replay import CATEGORIES

    parts = [
        f"{getattr(report, c)} {_REPLAY_WORDS[c][0 if dry_run else 1]}"
        for c in CATEGORIES
        if getattr(report, c) or c in ("execute", "skip")
    ]
    of = f" of {report.total}" if report.total is not None else ""
    head = "dry run, nothing changed: read" if dry_run else "replayed"
    console.print(f"{head} {report.read}{of} messages from {escape(source)}: {', '.join(parts)}")
    if report.redead_lettered:
        console.print(
            f"{report.redead_lettered} not settled: dead-lettered again to {escape(source)} "
            "with the reason; a later replay with the same group meets them again"
        )
    if report.interrupted:
        console.print("interrupted: the rest is left in place; run the same command to resume")
    if report.problems and not dry_run:
        table = folding_table("category", "scope", "key", "reason", "error", "read at")
        for p in report.problems[:20]:
            table.add_row(
                *(escape(str(v or "")) for v in (p.category, p.scope, p.key, p.reason, p.error)),
                escape(p.position),
            )
        console.print(table)
        more = len(report.problems) - 20
        if more > 0:
            console.print(f"... and {more} more (all of them with --json, and in the log)")


app = build_app()
