"""Every statement on one key finds it by the primary key, whatever the statistics say
(migration 8).

A store whose rows are nearly all completed, vacuumed as autovacuum would: its partial indexes
(leases, reconciliation, listing) hold no live entry, so the planner prices them at next to
nothing, while every two-phase claim since has added a dead entry to them. A statement on one
key that a partial index's predicate matched (a status condition) was then planned on that
index, and walked it whole: on a 5 million row store, reserve + complete lost half its rate in
a minute. Here the index scans each statement makes are counted (``pg_stat_user_indexes``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Attempt,
    DecisionKind,
    NotExecuted,
    OutcomeKind,
    PostgresStore,
    PrunePolicy,
    Retryable,
    run_two_phase,
)
from tests._migrations import apply_by_hand

ROWS = 100_000
FP = "v1:jcs:point"


@pytest.fixture
async def grown(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    """A store of ROWS completed records, vacuumed and analysed, on one connection (so its
    statistics can be flushed and read back)."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    assert pool is not None
    store = PostgresStore(pool, schema=f"point_{uuid.uuid4().hex[:10]}", lease=60)
    await store.migrate()
    await pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, result, result_kind,"
        " completed_at, expires_at)"
        " SELECT 's' || (i % 10), md5(i::text), $1, 'completed', '1', 'success', now(),"
        " now() + interval '1 day' FROM generate_series(1, $2) i",
        FP,
        ROWS,
    )
    await pool.execute(f"VACUUM (ANALYZE) {store.table}")
    yield store
    await pool.execute(f'DROP SCHEMA "{store.schema}" CASCADE')
    await pool.close()


async def index_scans(store: PostgresStore) -> dict[str, int]:
    async with store.pool.acquire() as conn:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT 1")  # the flush comes at the end of a transaction
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = await conn.fetch(
            "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes"
            " WHERE schemaname = $1 AND relname = 'idempotency_records'",
            store.schema,
        )
    return {r["indexrelname"]: r["idx_scan"] for r in rows}


async def charge(attempt: Attempt) -> str:
    return "charged"


async def decline(attempt: Attempt) -> str:
    raise Retryable("card declined, try again")


async def crash(attempt: Attempt) -> str:
    raise TimeoutError("the gateway did not answer")


async def test_statements_on_one_key_use_the_primary_key_not_a_partial_index(
    grown: PostgresStore,
) -> None:
    store = grown
    scope = "s3"
    # what makes the partial indexes big but priced as empty: many claims since the vacuum
    for i in range(300):
        assert (await run_two_phase(store, scope, f"warm-{i}", FP, charge)).kind is (
            OutcomeKind.EXECUTED
        )
    before = await index_scans(store)
    for i in range(10):
        # every transition of one key: claim, complete, fail, park, re-acquire, resolve
        await run_two_phase(store, scope, f"ok-{i}", FP, charge)
        await run_two_phase(store, scope, f"retry-{i}", FP, decline)
        await run_two_phase(store, scope, f"retry-{i}", FP, charge)  # re-acquired
        await run_two_phase(store, scope, f"park-{i}", FP, crash)
        await store.reconciliation.mark_reconcile_published(scope, f"park-{i}")
        await store.resolve(scope, f"park-{i}", NotExecuted("never sent"))
        await run_two_phase(store, scope, f"park-{i}", FP, charge)
        # an owner that vanished: its lease runs out, and the next reservation parks it
        claimed = await store.reserve(scope, f"zombie-{i}", FP, lease=timedelta(milliseconds=1))
        assert claimed.kind is DecisionKind.EXECUTE
    await store.pool.execute("SELECT pg_sleep(0.01)")
    for i in range(10):
        decision = await store.reserve(scope, f"zombie-{i}", FP)
        assert decision.kind is DecisionKind.UNKNOWN and decision.zombie
    after = await index_scans(store)
    used = {name: after[name] - before[name] for name in after if after[name] > before[name]}
    assert set(used) == {"idempotency_records_pkey"}, used


async def table_scans(store: PostgresStore) -> int:
    await index_scans(store)  # flushes
    async with store.pool.acquire() as conn:
        return int(
            await conn.fetchval(
                "SELECT seq_scan FROM pg_stat_user_tables"
                " WHERE schemaname = $1 AND relname = 'idempotency_records'",
                store.schema,
            )
        )


async def test_the_partial_indexes_still_serve_the_scans_they_are_for(
    grown: PostgresStore,
) -> None:
    """The sweeper, the reconciliation's due scan and the counts of unknown records state what
    their index's predicate asks for, so a grown store never reads the whole table for them."""
    store = grown
    await store.reserve("s1", "zombie", FP, lease=timedelta(milliseconds=1))
    await run_two_phase(store, "s1", "parked", FP, crash)
    await store.pool.execute("SELECT pg_sleep(0.01)")
    before, scans = await index_scans(store), await table_scans(store)
    assert (await store.maintenance.sweep()).parked == 1
    assert {r.key for r in await store.reconciliation.due_notices()} == {"zombie", "parked"}
    assert await store.maintenance.count_unknown() == 2
    assert await store.maintenance.count_unknown(["s1"], scheduled_only=True) == 2
    assert await store.maintenance.count_expired_leases() == 0
    after = await index_scans(store)
    used = {name for name in after if after[name] > before[name]}
    assert {
        "idempotency_records_leases",
        "idempotency_records_reconcile_due",
        "idempotency_records_listing",
    } <= used, used
    assert await table_scans(store) == scans


async def test_the_relay_settles_what_it_claimed_by_primary_key(grown: PostgresStore) -> None:
    """An outbox of sent messages, vacuumed, then a backlog of pending ones (an outage): the
    relay's settle statements must not walk the partial index of unsent messages."""
    store = grown
    insert = (
        f"INSERT INTO {store.schema}.outbox_messages (scope, unit_key, position, destination,"
        " body, idempotency_key, status, sent_at, created_at)"
        " SELECT 's', $1 || i, 0, 'payments', '\\x00', $1 || i, $2, $3, now() - interval '1 h'"
        " FROM generate_series(1, $4) i"
    )
    await store.pool.execute(insert, "sent-", "sent", datetime.now(UTC), 50_000)
    await store.pool.execute(f"VACUUM (ANALYZE) {store.schema}.outbox_messages")
    await store.pool.execute(insert, "late-", "pending", None, 5_000)
    plans: list[str] = []
    execute = store.outbox._execute

    async def explained(operation: str, scope: str, conn: Any, sql: str, *args: Any) -> int:
        plans.append("\n".join(r[0] for r in await conn.fetch(f"EXPLAIN {sql}", *args)))
        return await execute(operation, scope, conn, sql, *args)

    store.outbox._execute = explained  # type: ignore[method-assign]
    async with store.pool.acquire() as conn, conn.transaction():
        claimed = await store.outbox.claim_due(conn, 30, ["s"])  # (rows of no route)
        assert len(claimed) == 30
        await store.outbox.settle_claimed(
            conn,
            claimed[:10],
            [(m, "broker down", 5.0) for m in claimed[10:20]],
            [(m, "too large") for m in claimed[20:]],
        )
    assert len(plans) == 3
    for plan in plans:
        assert "outbox_messages_pkey" in plan and "outbox_messages_unsent" not in plan, plan
    counts = dict(
        await store.pool.fetch(
            f"SELECT status, count(*) FROM {store.schema}.outbox_messages GROUP BY status"
        )
    )
    assert counts == {"sent": 50_010, "pending": 4_980, "parked": 10}


async def test_an_index_a_failed_concurrent_build_left_invalid_is_rebuilt(pg_dsn: str) -> None:
    """Migration 8's header has operators build its indexes CONCURRENTLY first on big tables;
    a build that failed leaves an INVALID index under the name, which IF NOT EXISTS would skip
    while the old, valid index is dropped."""
    schema = f"upgrade_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await apply_by_hand(conn, schema, upto=7)  # the store as version 7 left it
        async with conn.transaction():
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
            # what a cancelled CREATE INDEX CONCURRENTLY leaves behind
            await conn.execute(
                "CREATE INDEX idempotency_records_reconcile_due"
                " ON idempotency_records (reconcile_after)"
            )
            await conn.execute(
                "UPDATE pg_index SET indisvalid = false"
                " WHERE indexrelid = 'idempotency_records_reconcile_due'::regclass"
            )
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
        assert pool is not None
        try:
            store = PostgresStore(pool, schema=schema)
            assert (await store.migrate())[:1] == [8]  # (and any later ones)
            await run_two_phase(store, "s", "parked", FP, crash)
            assert [r.key for r in await store.reconciliation.due_notices()] == ["parked"]
        finally:
            await pool.close()
        indexes = {
            r["indexname"]: (r["valid"], r["indexdef"])
            for r in await conn.fetch(
                "SELECT c.relname AS indexname, i.indisvalid AS valid,"
                " pg_get_indexdef(i.indexrelid) AS indexdef"
                " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relnamespace = $1::regnamespace",
                schema,
            )
        }
        valid, definition = indexes["idempotency_records_reconcile_due"]
        assert valid and "reconcile_after IS NOT NULL" in definition, definition
        assert "idempotency_records_reconcile" not in indexes
        assert "idempotency_records_attention" not in indexes
        assert indexes["idempotency_records_listing"][0]
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def test_a_prune_batch_finds_its_rows_again_by_address_not_by_key(
    grown: PostgresStore,
) -> None:
    """The rows a batch picked are locked, so their ctid holds: deleting (or soft-expiring)
    them by it costs no descent of the primary key per row, which live reservations beside a
    prune waited for (``store.prune.*`` in the benchmarks)."""
    store = grown
    await store.pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = 's1' AND key < '4'"
    )
    before = await index_scans(store)
    deleted = await store.maintenance.prune(batch_size=500)
    after = await index_scans(store)
    assert deleted.rows > 2_000 and deleted.finished
    assert after["idempotency_records_pkey"] == before["idempotency_records_pkey"]
    await store.pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = 's2' AND key < '4'"
    )
    before = await index_scans(store)
    soft = await store.maintenance.prune(policy=PrunePolicy.SOFT, batch_size=500)
    after = await index_scans(store)
    assert soft.rows > 2_000 and soft.finished
    assert after["idempotency_records_pkey"] == before["idempotency_records_pkey"]
