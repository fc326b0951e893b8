"""Pruning walks the expiry index once, oldest first, whatever the physical order of the rows:
what keeps a prune of a million expired rows in a big store fast (see ``store.prune.*`` in the
benchmarks); and it keeps its pace (``max_rows_per_s``), which is what keeps the live
reservations beside it at their speed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from consumer_idem import PostgresStore, PrunePolicy


async def add(store: PostgresStore, n: int, status: str, ages_s: list[float]) -> None:
    """``n`` rows of ``status`` that expired ``ages_s[i]`` seconds ago, inserted in that order."""
    await store.pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, reconcile_after, expires_at)"
        " SELECT 's', $1 || i, 'fp', $2::text, CASE WHEN $2::text = 'unknown' THEN now() END,"
        " now() - make_interval(secs => ($3::float8[])[i])"
        " FROM generate_series(1, $4) i",
        f"{status}-",
        status,
        ages_s,
        n,
    )


async def test_prune_deletes_the_oldest_first_whatever_the_heap_order(
    own_store: PostgresStore,
) -> None:
    # stored newest-expired first: a scan in physical order would meet the youngest first
    await add(own_store, 200, "completed", [float(i + 1) for i in range(200)])
    await own_store.pool.execute(f"ANALYZE {own_store.table}")
    report = await own_store.maintenance.prune(batch_size=50, max_batches=1)
    assert report.rows == 50 and not report.finished
    left = await own_store.pool.fetch(f"SELECT key FROM {own_store.table}")
    # completed-1 expired 1 s ago ... completed-200 200 s ago: the last 50 stored are gone
    assert sorted(int(r["key"].split("-")[1]) for r in left) == list(range(1, 151))


async def expiry_index_reads(store: PostgresStore, admin: asyncpg.Pool) -> int:
    async with store.pool.acquire() as conn:  # the store's only connection: flush its counts
        await conn.execute("SELECT pg_stat_force_next_flush()")
    for _ in range(50):
        await asyncio.sleep(0.1)
        n = await admin.fetchval(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE schemaname = $1"
            " AND indexrelname = 'idempotency_records_expiry'",
            store.schema,
        )
        if n:
            return int(n)
    raise AssertionError("no statistics for the expiry index")


async def test_each_batch_starts_where_the_last_one_ended(
    own_store: PostgresStore, pg_pool: asyncpg.Pool
) -> None:
    # 2,000 unknown rows that expired long ago are never pruned (reconciliation owns them);
    # 2,000 completed ones after them are, in 40 batches of 50
    await add(own_store, 2000, "unknown", [86400.0 + i for i in range(2000)])
    await add(own_store, 2000, "completed", [3600.0 - i for i in range(2000)])
    await own_store.pool.execute(f"ANALYZE {own_store.table}")
    report = await own_store.maintenance.prune(batch_size=50)
    assert report.rows == 2000 and report.batches == 41
    # walked once: about 4,000 entries, not 40 times over the 2,000 unknown ones (80,000)
    assert await expiry_index_reads(own_store, pg_pool) < 8000
    assert await own_store.maintenance.count_unknown() == 2000


async def test_a_paced_prune_spreads_its_batches_at_its_pace(own_store: PostgresStore) -> None:
    await add(own_store, 40, "completed", [float(i + 1) for i in range(40)])
    started = time.perf_counter()
    report = await own_store.maintenance.prune(batch_size=10, max_rows_per_s=100)
    took = time.perf_counter() - started
    assert (report.rows, report.batches, report.finished) == (40, 5, True)
    # each batch after the first waits for the 10 rows before it (0.1 s at 100 rows/s); the
    # event loop may wake a timer up to its clock's resolution early, hence the 5 ms
    assert took >= 4 * 0.1 - 0.005, took


async def test_a_stop_ends_a_paced_prune_while_it_waits(own_store: PostgresStore) -> None:
    await add(own_store, 40, "completed", [float(i + 1) for i in range(40)])
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    # after its first batch the prune would wait 1,000 s for its next one
    report = await asyncio.wait_for(
        own_store.maintenance.prune(batch_size=10, max_rows_per_s=0.01, stop=stop), 10
    )
    assert (report.rows, report.batches, report.finished) == (10, 1, False)
    rest = await own_store.maintenance.prune(batch_size=10, max_rows_per_s=0)
    assert (rest.rows, rest.finished) == (30, True)


@pytest.mark.parametrize(
    ("argument", "error"),
    [
        ({"max_rows_per_s": -1.0}, ValueError),
        ({"max_rows_per_s": float("nan")}, ValueError),  # every wait NaN: no pace at all
        ({"max_rows_per_s": float("inf")}, ValueError),  # every wait zero: no pace at all
        ({"max_rows_per_s": "100"}, TypeError),
        ({"max_rows_per_s": True}, TypeError),
        ({"max_batches": 0}, ValueError),  # no batch, yet it said it had finished
        # a soft-expired row already due: the same prune deleted it too, counted twice
        ({"policy": PrunePolicy.SOFT, "audit_retention": -3600}, ValueError),
    ],
)
async def test_a_bad_pace_or_batch_count_is_refused_before_any_batch(
    own_store: PostgresStore, argument: dict[str, Any], error: type[Exception]
) -> None:
    await add(own_store, 10, "completed", [float(i + 1) for i in range(10)])
    with pytest.raises(error, match=list(argument)[-1]):
        await own_store.maintenance.prune(**argument)
    assert await own_store.maintenance.count_prunable() == 10


async def test_a_cancellation_with_the_stop_reaches_the_caller(own_store: PostgresStore) -> None:
    # a shutdown that sets the stop and cancels the task at once, while the prune waits: on
    # Python 3.11 asyncio.wait_for returned normally there, and the cancellation was lost
    await add(own_store, 40, "completed", [float(i + 1) for i in range(40)])
    stop, first = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        own_store.maintenance.prune(
            batch_size=10, max_rows_per_s=0.01, stop=stop, on_batch=lambda _: first.set()
        )
    )
    await asyncio.wait_for(first.wait(), 10)
    await asyncio.sleep(0.05)  # the prune is waiting for its next batch
    stop.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_prune_takes_only_what_had_expired_when_it_began(
    own_store: PostgresStore,
) -> None:
    await add(own_store, 30, "completed", [float(i + 1) for i in range(30)])
    # these expire 0.3 s after the prune begins, while its pace holds it (0.25 s a batch)
    await add(own_store, 5, "failed_retryable", [-0.3] * 5)
    report = await own_store.maintenance.prune(batch_size=10, max_rows_per_s=40)
    assert (report.rows, report.finished) == (30, True)
    await asyncio.sleep(0.3)
    assert await own_store.maintenance.count_prunable() == 5


async def test_a_soft_prune_never_meets_its_own_rows_again(own_store: PostgresStore) -> None:
    # with no audit time the rows it soft-expires are due at once: the same prune must not
    # delete them too (and count each twice); a later prune does
    await add(own_store, 30, "completed", [float(i + 1) for i in range(30)])
    soft = await own_store.maintenance.prune(
        policy=PrunePolicy.SOFT, batch_size=10, audit_retention=0, max_rows_per_s=0
    )
    assert (soft.rows, soft.finished) == (30, True)
    statuses = await own_store.pool.fetch(
        f"SELECT status, count(*) AS n FROM {own_store.table} GROUP BY status"
    )
    assert [(r["status"], r["n"]) for r in statuses] == [("expired", 30)]
    gone = await own_store.maintenance.prune(policy=PrunePolicy.SOFT, max_rows_per_s=0)
    assert gone.rows == 30
