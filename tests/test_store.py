"""The Postgres store's decisions and transitions, against the real database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    DecisionKind,
    PostgresStore,
    PrunePolicy,
    Status,
    StoreUnavailable,
)
from consumer_idem.errors import SchemaMissing
from consumer_idem.stores.postgres import migrate

FP = "v1:jcs:aaa"
OTHER_FP = "v1:jcs:bbb"


async def expire_lease(pool: asyncpg.Pool, store: PostgresStore, scope: str, key: str) -> None:
    await pool.execute(
        f"UPDATE {store.table} SET locked_until = now() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        scope,
        key,
    )


async def age(pool: asyncpg.Pool, store: PostgresStore, scope: str, key: str) -> None:
    await pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        scope,
        key,
    )


async def test_migrate_is_idempotent_and_safe_concurrently(pg_pool: asyncpg.Pool) -> None:
    schema = f"mig_{uuid.uuid4().hex[:8]}"
    stores = [PostgresStore(pg_pool, schema=schema) for _ in range(5)]
    applied = await asyncio.gather(*(s.migrate() for s in stores))
    # one of the five applies every migration, the others find nothing left to do
    assert sorted(map(len, applied)) == [0, 0, 0, 0, len(migrate.available())]
    assert await stores[0].migrate() == []
    decision = await stores[0].reserve("s", "k", FP)
    assert decision.kind is DecisionKind.EXECUTE


async def test_prune_deletes_expired_rows_and_leaves_live_ones(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    states: dict[str, Any] = {}
    for i in range(25):
        d = await store.reserve(scope, f"old-{i}", FP)
        await store.complete(scope, f"old-{i}", d.token, i)
        await age(pg_pool, store, scope, f"old-{i}")
    d = await store.reserve(scope, "fresh", FP)
    await store.complete(scope, "fresh", d.token, "keep")
    states["running"] = await store.reserve(scope, "running", FP)
    d = await store.reserve(scope, "parked", FP)
    await store.mark_unknown(scope, "parked", d.token)
    for key in ("running", "parked"):
        await age(pg_pool, store, scope, key)
    pruned = await store.prune(batch_size=10)
    assert pruned >= 25
    left = {
        r["key"]
        for r in await pg_pool.fetch(f"SELECT key FROM {store.table} WHERE scope = $1", scope)
    }
    assert left == {"fresh", "running", "parked"}
    assert store.metrics.count("pruned", scope) == 25


async def test_soft_prune_expires_then_deletes(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    d = await store.reserve(scope, "k", FP)
    await store.complete(scope, "k", d.token, "r")
    await age(pg_pool, store, scope, "k")
    await store.prune(policy=PrunePolicy.SOFT)
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.EXPIRED
    # an expired record is never replayed: the key is new work again, whatever its payload
    fresh = await store.reserve(scope, "k", OTHER_FP)
    assert fresh.kind is DecisionKind.EXECUTE and fresh.record.result is None
    await store.fail_retryable(scope, "k", fresh.token)
    await age(pg_pool, store, scope, "k")
    await store.prune(policy=PrunePolicy.SOFT)
    await age(pg_pool, store, scope, "k")
    await store.prune(policy=PrunePolicy.SOFT)
    assert await store.get(scope, "k") is None


async def test_store_down_is_store_unavailable() -> None:
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    dead = PostgresStore(pool, command_timeout=2)
    try:
        with pytest.raises(StoreUnavailable):
            await dead.reserve("s", "k", FP)
        assert dead.metrics.count("store_error") == 1
    finally:
        await pool.close()


async def test_an_unmigrated_schema_is_a_configuration_error_naming_the_fix(
    pg_pool: asyncpg.Pool,
) -> None:
    # not StoreUnavailable: waiting would never cure it (consumers would retry for ever)
    with pytest.raises(SchemaMissing, match=r"reserve.*consumer-idem migrate"):
        await PostgresStore(pg_pool, schema="never_migrated").reserve("s", "k", FP)


def test_schema_name_is_validated(pg_pool: asyncpg.Pool) -> None:
    with pytest.raises(ValueError, match="invalid schema"):
        PostgresStore(pg_pool, schema='x"; drop table y; --')
