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
    pruned = await store.maintenance.prune(batch_size=10)
    assert pruned.rows >= 25 and pruned.finished
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
    await store.maintenance.prune(policy=PrunePolicy.SOFT)
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.EXPIRED
    # an expired record is never replayed: the key is new work again, whatever its payload
    fresh = await store.reserve(scope, "k", OTHER_FP)
    assert fresh.kind is DecisionKind.EXECUTE and fresh.record.result is None
    await store.fail_retryable(scope, "k", fresh.token)
    await age(pg_pool, store, scope, "k")
    await store.maintenance.prune(policy=PrunePolicy.SOFT)
    await age(pg_pool, store, scope, "k")
    await store.maintenance.prune(policy=PrunePolicy.SOFT)
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


async def test_a_key_that_fails_again_lives_its_full_retention_again(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    """A failed_retryable key whose expiry passed is not pruned between two attempts: each
    re-acquisition, recorded failure and "not executed" resolution extends it."""
    from consumer_idem import NotExecuted

    first = await store.reserve(scope, "k", FP)
    assert first.token is not None
    await store.fail_retryable(scope, "k", first.token, "boom")
    await age(pg_pool, store, scope, "k")
    again = await store.reserve(scope, "k", FP)  # re-acquired past its old expiry
    assert again.kind is DecisionKind.EXECUTE and again.record.attempts == 2
    assert again.record.expires_at > again.record.updated_at  # extended, not left behind

    await store.fail_retryable(scope, "k", again.token, "boom")  # type: ignore[arg-type]
    await age(pg_pool, store, scope, "k")
    recorded = await store.fast_path.record_failure(
        scope, "k", FP, "failed_retryable", "boom again"
    )
    assert recorded is not None and recorded.attempts == 3
    assert recorded.expires_at > recorded.updated_at

    await age(pg_pool, store, scope, "k")
    await pg_pool.execute(
        f"UPDATE {store.table} SET status = 'unknown' WHERE scope = $1 AND key = $2", scope, "k"
    )
    resolved = await store.resolve(scope, "k", NotExecuted())
    assert resolved.status is Status.FAILED_RETRYABLE
    assert resolved.expires_at > resolved.updated_at


async def test_reserve_gives_up_on_contention_with_a_transient_error(
    store: PostgresStore, pg_pool: asyncpg.Pool
) -> None:
    """Losing every round of the reservation loop is contention: SQLSTATE 40001, an outage the
    caller waits out, never data refused (which would dead-letter the delivery)."""
    source = await pg_pool.fetchval(
        "SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = $1 AND p.proname = 'reserve'",
        store.schema,
    )
    assert "ERRCODE = 'serialization_failure'" in source
    from consumer_idem.stores.postgres.errors import kind_of

    class Contention(asyncpg.SerializationError):
        pass

    assert kind_of(Contention("changed under every attempt")) is StoreUnavailable


def test_two_migrations_with_one_version_are_refused() -> None:
    found = migrate.available()
    with pytest.raises(RuntimeError, match=r"share version\(s\) \[4\]"):
        migrate.check_versions([*found, migrate.Migration(4, "another", "SELECT 1")])
