"""The prune removes delivery attempt counts (``delivery_attempts``) that no longer mean
anything: those of a key whose record it prunes (the key is new work, with a fresh budget), and
those not counted for longer than their scope's retention (a key dead-lettered, or whose
record never committed); the others stay, in bounded batches like the records."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from consumer_idem import PostgresStore, PrunePolicy


def retention(scope: str) -> timedelta:
    return timedelta(hours=1) if scope == "short" else timedelta(days=30)


@pytest.fixture
async def own_store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    """A store in a schema of its own, its scopes kept 1 hour (``short``) or 30 days."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    assert pool is not None
    store = PostgresStore(pool, schema=f"prune_att_{uuid.uuid4().hex[:10]}", retention=retention)
    await store.migrate()
    yield store
    await pool.execute(f'DROP SCHEMA "{store.schema}" CASCADE')
    await pool.close()


async def record(store: PostgresStore, scope: str, key: str, expired: bool) -> None:
    await store.pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, expires_at)"
        " VALUES ($1, $2, 'fp', 'completed', now() + CASE WHEN $3 THEN -1 ELSE 1 END"
        " * interval '1 hour')",
        scope,
        key,
        expired,
    )


async def counted(store: PostgresStore, scope: str, key: str, hours_ago: float) -> None:
    await store.pool.execute(
        f'INSERT INTO "{store.schema}".delivery_attempts (scope, key, attempts, updated_at)'
        " VALUES ($1, $2, 2, now() - make_interval(secs => $3))",
        scope,
        key,
        hours_ago * 3600,
    )


async def left(store: PostgresStore) -> set[tuple[str, str]]:
    rows = await store.pool.fetch(f'SELECT scope, key FROM "{store.schema}".delivery_attempts')
    return {(r["scope"], r["key"]) for r in rows}


@pytest.mark.parametrize("policy", list(PrunePolicy))
async def test_prune_removes_the_attempts_of_pruned_keys_and_of_keys_past_retention(
    own_store: PostgresStore, policy: PrunePolicy
) -> None:
    await record(own_store, "long", "pruned", expired=True)
    await counted(own_store, "long", "pruned", 0.5)
    await record(own_store, "long", "kept", expired=False)
    await counted(own_store, "long", "kept", 0.5)
    for n in range(3):  # no record, counted 2 hours ago: past the 1 hour of "short"
        await counted(own_store, "short", f"old{n}", 2)
    await counted(own_store, "short", "recent", 0.5)
    await counted(own_store, "long", "old", 2)  # 2 hours is within the 30 days of "long"

    report = await own_store.maintenance.prune(policy=policy, batch_size=2, max_rows_per_s=0)

    assert report.rows == 1 and report.attempts == 4 and report.finished
    assert await left(own_store) == {("long", "kept"), ("short", "recent"), ("long", "old")}
    # the records in one batch, the three old counts in two more: bounded like the records
    assert report.batches == 3


async def test_a_prune_stopped_by_max_batches_says_attempts_may_be_left(
    own_store: PostgresStore,
) -> None:
    for n in range(4):
        await counted(own_store, "short", f"old{n}", 2)
    report = await own_store.maintenance.prune(batch_size=2, max_batches=2, max_rows_per_s=0)
    assert (report.attempts, report.finished) == (2, False)
    assert len(await left(own_store)) == 2
