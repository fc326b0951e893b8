"""What every command shares: the options, the store it opens, how it runs and exits, and
the tables it prints."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape
from rich.table import Table

from consumer_idem.cli.output import (
    CliError,
    ExitCode,
    age,
    console,
    fail,
    setup_logging,
    store_errors_fatal,
)
from consumer_idem.cli.settings import Settings, load_settings
from consumer_idem.errors import ConsumerIdemError, SchemaMissing
from consumer_idem.stores.postgres.maintenance import (
    KeyInfo,
    StoreStats,
)
from consumer_idem.stores.postgres.outbox import OutboxStats
from consumer_idem.stores.postgres.pooler import create_pool
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Record, Status

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
