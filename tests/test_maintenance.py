"""The store's maintenance part (``store.maintenance``): typed, frozen reports, against the real
database."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from datetime import timedelta

import asyncpg
import pytest

from consumer_idem import (
    KeyPage,
    PostgresStore,
    PrunePolicy,
    PruneReport,
    ScopeCounts,
    Status,
    StoreStats,
    SweepReport,
)
from consumer_idem.stores.postgres.maintenance import decode_cursor

FP = "v1:jcs:x"


async def expire_leases(pool: asyncpg.Pool, store: PostgresStore, scope: str) -> None:
    await pool.execute(
        f"UPDATE {store.table} SET locked_until = now() - interval '1 s'"
        " WHERE scope = $1 AND status = 'in_progress'",
        scope,
    )


async def past_retention(pool: asyncpg.Pool, store: PostgresStore, scope: str) -> None:
    await pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 s' WHERE scope = $1", scope
    )


async def age_by(pool: asyncpg.Pool, store: PostgresStore, scope: str, key: str, s: int) -> None:
    await pool.execute(
        f"UPDATE {store.table} SET updated_at = now() - make_interval(secs => $3)"
        " WHERE scope = $1 AND key = $2",
        scope,
        key,
        s,
    )


async def test_sweep_reports_each_parked_key_and_logs_it_by_name(
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    scope: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for key in ("z1", "z2", "alive"):
        await store.reserve(scope, key, FP, lease=60)
    await pg_pool.execute(
        f"UPDATE {store.table} SET locked_until = now() - interval '1 s'"
        " WHERE scope = $1 AND key <> 'alive'",
        scope,
    )
    batches: list[SweepReport] = []
    with caplog.at_level(logging.WARNING, logger="consumer_idem"):
        report = await store.maintenance.sweep(batch_size=1, on_batch=batches.append)
    assert report.parked >= 2 and report.batches == len(batches) >= 3  # one row per batch
    assert [b.parked for b in batches] == sorted(b.parked for b in batches)  # running totals
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.parked = 0  # type: ignore[misc]
    ours = [r.getMessage() for r in caplog.records if scope in r.getMessage()]
    assert sorted(m.split(": ")[0] for m in ours) == [
        f"scope={scope} key=z1",
        f"scope={scope} key=z2",
    ]
    assert all("lease expired" in m and "parked as unknown" in m for m in ours)
    assert (await store.get(scope, "alive")).status is Status.IN_PROGRESS  # type: ignore[union-attr]


@pytest.mark.parametrize("operation", ["sweep", "prune_delete", "prune_soft"])
async def test_a_batch_never_touches_more_rows_than_its_size(
    pg_pool: asyncpg.Pool, store: PostgresStore, scope: str, operation: str
) -> None:
    """Regression: the batch was a LIMIT subquery joined to the table, which the planner may
    rescan per joined row (each rescan locking further rows), so one statement swept every
    expired lease whatever ``batch_size`` said."""
    for i in range(6):
        await store.reserve(scope, f"k{i}", FP, lease=60)
    if operation == "sweep":
        await expire_leases(pg_pool, store, scope)
    else:
        await pg_pool.execute(
            f"UPDATE {store.table} SET status = 'completed', owner_token = NULL,"
            " locked_until = NULL WHERE scope = $1",
            scope,
        )
        await past_retention(pg_pool, store, scope)
    totals: list[int] = []
    if operation == "sweep":
        await store.maintenance.sweep(batch_size=2, on_batch=lambda r: totals.append(r.parked))
    else:
        policy = PrunePolicy.DELETE if operation == "prune_delete" else PrunePolicy.SOFT
        await store.maintenance.prune(
            policy=policy, batch_size=2, on_batch=lambda r: totals.append(r.rows)
        )
    steps = [b - a for a, b in zip([0, *totals], totals, strict=False)]
    assert steps and max(steps) <= 2 and totals[-1] >= 6, steps


async def test_prune_report_is_typed_counts_batches_and_says_when_it_stopped_early(
    pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    for i in range(25):
        d = await store.reserve(scope, f"old-{i}", FP)
        await store.complete(scope, f"old-{i}", d.token, i)
    await past_retention(pg_pool, store, scope)
    assert await store.maintenance.count_prunable() >= 25
    seen: list[PruneReport] = []
    partial = await store.maintenance.prune(batch_size=10, max_batches=1, on_batch=seen.append)
    assert partial == PruneReport(
        policy=PrunePolicy.DELETE,
        rows=10,
        batches=1,
        longest_statement_s=partial.longest_statement_s,
        finished=False,  # a full batch, then max_batches: more may be due
    )
    assert seen == [partial]
    stop = asyncio.Event()
    stop.set()  # stops after the batch in hand
    stopped = await store.maintenance.prune(batch_size=10, stop=stop)
    assert (stopped.rows, stopped.batches, stopped.finished) == (10, 1, False)
    rest = await store.maintenance.prune(batch_size=10)
    assert rest.finished and rest.rows >= 5
    left = await pg_pool.fetchval(f"SELECT count(*) FROM {store.table} WHERE scope = $1", scope)
    assert left == 0


async def test_stats_is_typed_per_scope_with_every_status(
    pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    d = await store.reserve(scope, "done", FP)
    await store.complete(scope, "done", d.token, 1)
    d = await store.reserve(scope, "parked", FP)
    await store.mark_unknown(scope, "parked", d.token, "gateway timeout")
    await store.reserve(scope, "running", FP)
    stats = await store.maintenance.stats(scope)
    assert isinstance(stats, StoreStats)
    assert stats.scopes == (
        ScopeCounts(scope, in_progress=1, completed=1, failed_retryable=0, unknown=1, expired=0),
    )
    counts = stats.scope(scope)
    assert counts is not None and counts.total == 3 and counts.count(Status.UNKNOWN) == 1
    assert stats.oldest_unknown_s is not None and stats.oldest_in_progress_s is not None
    assert stats.reconcile_backlog == 1 and stats.with_operator == 0
    assert stats.as_dict()["scopes"][scope]["unknown"] == 1
    assert (await store.maintenance.stats("no-such-scope")).scopes == ()


async def test_list_keys_filters_by_status_scope_prefix_and_age(
    pg_pool: asyncpg.Pool, store: PostgresStore
) -> None:
    prefix = f"ls-{uuid.uuid4().hex[:8]}"
    a, b = f"{prefix}.a", f"{prefix}.b"
    for scope in (a, b):
        d = await store.reserve(scope, "done", FP)
        await store.complete(scope, "done", d.token, 1)
        d = await store.reserve(scope, "parked", FP)
        await store.mark_unknown(scope, "parked", d.token, "gateway timeout")
    await age_by(pg_pool, store, a, "parked", 7200)

    page = await store.maintenance.list_keys(scope_prefix=prefix)
    assert isinstance(page, KeyPage) and page.next_cursor is None
    assert (page.keys[0].scope, page.keys[0].key) == (a, "parked")  # oldest first
    assert len(page.keys) == 4

    unknown = await store.maintenance.list_keys(statuses=[Status.UNKNOWN], scope_prefix=prefix)
    assert {(k.scope, k.key) for k in unknown.keys} == {(a, "parked"), (b, "parked")}
    assert all(k.last_error == "gateway timeout" for k in unknown.keys)

    old = await store.maintenance.list_keys(
        statuses=["unknown"], scope_prefix=prefix, older_than=timedelta(hours=1)
    )
    assert [(k.scope, k.key) for k in old.keys] == [(a, "parked")]
    assert 7100 < old.keys[0].age_s < 7300

    only_b = await store.maintenance.list_keys(scope_prefix=b)
    assert {k.scope for k in only_b.keys} == {b}
    # a prefix is a prefix, not a pattern: LIKE wildcards match themselves only
    assert (await store.maintenance.list_keys(scope_prefix=f"{prefix}%")).keys == ()


async def test_list_keys_pages_by_keyset_without_gaps_or_repeats(
    pg_pool: asyncpg.Pool, store: PostgresStore
) -> None:
    scope = f"page-{uuid.uuid4().hex[:8]}"
    for i in range(23):
        d = await store.reserve(scope, f"k{i:02d}", FP)
        await store.complete(scope, f"k{i:02d}", d.token, i)
    # ties on updated_at are ordered by scope and key: the cursor carries all three
    await pg_pool.execute(
        f"UPDATE {store.table} SET updated_at = '2020-01-01' WHERE scope = $1 AND key < 'k10'",
        scope,
    )
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page = await store.maintenance.list_keys(scope_prefix=scope, limit=5, after=after)
        pages += 1
        seen += [k.key for k in page.keys]
        if page.next_cursor is None:
            break
        assert page.next_cursor == page.keys[-1].cursor
        after = page.next_cursor
    assert pages == 5 and seen == [f"k{i:02d}" for i in range(23)]
    _at, scope_in_cursor, key = decode_cursor(page.keys[-1].cursor)
    assert (scope_in_cursor, key) == (scope, "k22")
    with pytest.raises(ValueError, match="invalid cursor"):
        await store.maintenance.list_keys(after="not-a-cursor")
    with pytest.raises(ValueError, match="limit"):
        await store.maintenance.list_keys(limit=0)


async def test_counts_for_progress(pg_pool: asyncpg.Pool, store: PostgresStore) -> None:
    scope = f"count-{uuid.uuid4().hex[:8]}"
    await store.reserve(scope, "lease", FP)
    await expire_leases(pg_pool, store, scope)
    assert await store.maintenance.count_expired_leases() >= 1
    [lease] = (await store.maintenance.list_keys(scope_prefix=scope)).keys
    assert lease.lease_left_s is not None and lease.lease_left_s < 0  # expired: a zombie
    d = await store.reserve(scope, "parked", FP)
    await store.mark_unknown(scope, "parked", d.token, "timeout")
    d = await store.reserve(scope, "operator", FP)
    await store.mark_unknown(scope, "operator", d.token, "timeout")
    await store.reconciliation.hand_to_operator(scope, "operator", "gave up")
    assert await store.maintenance.count_unknown([scope]) == 2
    assert await store.maintenance.count_unknown([scope], scheduled_only=True) == 1


@pytest.mark.parametrize(
    "statuses", [["unknown"], ["failed_retryable"], ["in_progress", "failed_retryable", "unknown"]]
)
async def test_listing_the_statuses_of_stuck_keys_can_use_the_partial_index(
    pg_pool: asyncpg.Pool, store: PostgresStore, statuses: list[str]
) -> None:
    """Migration 8's listing index serves the listing only if the query names the statuses as
    literals the planner can match against the index predicate (a parameter would not)."""
    cursor = "WyIyMDIwLTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwgInMiLCAiayJd"  # (2020-01-01, s, k)
    sql, args = store.maintenance.listing_query(
        statuses=statuses, scope_prefix="pay", older_than=60, after=cursor
    )
    async with pg_pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")  # what the planner *can* use
        await conn.execute("SET LOCAL enable_bitmapscan = off")
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN {sql}", *args))
    # an index serves it (the planner may prefer the reconcile index for `unknown` alone,
    # depending on what else the table holds); never a scan of the whole table
    assert "Seq Scan" not in plan, plan
    if "failed_retryable" in statuses:  # only the listing index covers these
        assert "idempotency_records_listing" in plan, plan
