"""Pruning at volume: 100,000 expired rows in small batches, from several pruners at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import asyncpg
import pytest

from consumer_idem import PostgresStore, PruneReport


async def test_prune_100k_expired_rows_in_short_batches_from_three_pruners(
    pg_pool: asyncpg.Pool, store: PostgresStore
) -> None:
    scope = f"prune-{uuid.uuid4().hex[:8]}"
    await pg_pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, result, result_kind,"
        " completed_at, expires_at)"
        " SELECT $1, 'k' || g, 'v1:jcs:x', 'completed', '{\"ok\":1}', 'success', now(),"
        " now() - interval '1 minute' FROM generate_series(1, 100000) g",
        scope,
    )
    await pg_pool.execute(  # live rows that must survive
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, completed_at, expires_at)"
        " SELECT $1, 'live' || g, 'v1:jcs:x', 'completed', now(), now() + interval '1 day'"
        " FROM generate_series(1, 100) g",
        scope,
    )
    pruners = [PostgresStore(pg_pool, schema=store.schema) for _ in range(3)]
    largest: list[int] = []

    def batch_sizes() -> Callable[[PruneReport], None]:
        """Each pruner's rows per statement, from its running totals."""
        seen = 0

        def on_batch(report: PruneReport) -> None:
            nonlocal seen
            largest.append(report.rows - seen)
            seen = report.rows

        return on_batch

    reports = await asyncio.gather(
        *(p.maintenance.prune(batch_size=1000, on_batch=batch_sizes()) for p in pruners)
    )
    assert sum(r.rows for r in reports) == 100_000  # SKIP LOCKED: none deleted twice or missed
    assert all(r.finished for r in reports)
    longest = max(r.longest_statement_s for r in reports)
    batches = sum(r.batches for r in reports)
    print(f"\nprune: 100000 rows, {batches} batches, longest statement {longest * 1000:.1f} ms")
    assert batches >= 100 and max(largest) <= 1000  # each statement locks at most one batch
    left = await pg_pool.fetchval(f"SELECT count(*) FROM {store.table} WHERE scope = $1", scope)
    assert left == 100


async def test_a_batch_size_below_one_is_refused(store: PostgresStore) -> None:
    """A batch of none deletes nothing and never finishes: refused before any statement."""
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        await asyncio.wait_for(store.maintenance.prune(batch_size=0), 5)
