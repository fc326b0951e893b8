"""The store's records: ``migrate``, ``stats``, ``list``, ``inspect`` and ``evict``."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from consumer_idem.cli.common import (
    DsnOpt,
    JsonOpt,
    SchemaOpt,
    emit,
    folding_table,
    key_row,
    known_record,
    known_scope,
    open_store,
    outbox_lines,
    record_dict,
    run,
    stats_table,
    store_call,
)
from consumer_idem.cli.output import (
    console,
    evict_consequence,
    evicted_line,
    fail,
    held_line,
    note,
    parse_duration,
)
from consumer_idem.stores.postgres.maintenance import (
    KeyPage,
    StoreStats,
)
from consumer_idem.stores.postgres.outbox import OutboxStats
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Eviction, Status


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
