"""Pruning at volume: 100,000 expired rows in small batches, from several pruners at once."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from consumer_idem import PostgresStore


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
    counts = await asyncio.gather(*(p.prune(batch_size=1000) for p in pruners))
    assert sum(counts) == 100_000  # SKIP LOCKED: no row deleted twice, none missed
    longest = max(p.last_prune.longest_statement_s for p in pruners)
    batches = sum(p.last_prune.batches for p in pruners)
    print(f"\nprune: 100000 rows, {batches} batches, longest statement {longest * 1000:.1f} ms")
    assert batches >= 100  # each statement locks one batch of at most 1,000 rows
    left = await pg_pool.fetchval(f"SELECT count(*) FROM {store.table} WHERE scope = $1", scope)
    assert left == 100
