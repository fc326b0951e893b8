"""The Postgres store's decisions and transitions, against the real database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    DecisionKind,
    Executed,
    LeaseLost,
    NotExecuted,
    NotUnknown,
    PostgresStore,
    PrunePolicy,
    ResultKind,
    Status,
    StoredResponse,
    StoreUnavailable,
)

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
    assert sorted(map(len, applied)) == [0, 0, 0, 0, 1]
    assert await stores[0].migrate() == []
    decision = await stores[0].reserve("s", "k", FP)
    assert decision.kind is DecisionKind.EXECUTE


async def test_execute_complete_then_replay_byte_identical(
    store: PostgresStore, scope: str
) -> None:
    first = await store.reserve(scope, "k1", FP)
    assert first.kind is DecisionKind.EXECUTE
    assert first.record.attempts == 1
    result = {"z": 1, "a": [1.5, "é"], "m": None}
    done = await store.complete(scope, "k1", first.token, result)
    assert done.status is Status.COMPLETED
    again = await store.reserve(scope, "k1", FP)
    assert again.kind is DecisionKind.REPLAY
    assert again.record.result == result
    assert again.record.result_json == done.result_json == '{"z":1,"a":[1.5,"é"],"m":null}'
    assert again.record.result_kind is ResultKind.SUCCESS
    assert store.metrics.count("replay", scope) == 1
    assert store.metrics.count("created", scope) == 1


async def test_http_response_is_stored_and_replayed_exactly(
    store: PostgresStore, scope: str
) -> None:
    decision = await store.reserve(scope, "k", FP)
    body = b'{"payment_id": "p1",  "status":"ok"}\n\x00\xff'
    response = StoredResponse(201, {"content-type": "application/json", "location": "/p/1"}, body)
    await store.complete(scope, "k", decision.token, None, response=response)
    replay = await store.reserve(scope, "k", FP)
    assert replay.record.response == response


async def test_in_progress_decision_carries_retry_after(store: PostgresStore, scope: str) -> None:
    await store.reserve(scope, "k", FP, lease=20)
    other = await store.reserve(scope, "k", FP)
    assert other.kind is DecisionKind.IN_PROGRESS
    assert 10 < other.retry_after <= 20


@pytest.mark.parametrize("state", ["in_progress", "completed", "failed_retryable", "unknown"])
async def test_misuse_in_every_state(store: PostgresStore, scope: str, state: str) -> None:
    d = await store.reserve(scope, "k", FP)
    if state == "completed":
        await store.complete(scope, "k", d.token, {"ok": True})
    elif state == "failed_retryable":
        await store.fail_retryable(scope, "k", d.token)
    elif state == "unknown":
        await store.mark_unknown(scope, "k", d.token)
    misuse = await store.reserve(scope, "k", OTHER_FP)
    assert misuse.kind is DecisionKind.MISUSE
    assert misuse.record.status == state
    assert store.metrics.count("key_misuse", scope) == 1


async def test_failed_retryable_is_reacquired_by_exactly_one_racer(
    store: PostgresStore, scope: str
) -> None:
    d = await store.reserve(scope, "k", FP)
    await store.fail_retryable(scope, "k", d.token, "gateway refused the connection")
    decisions = await asyncio.gather(*(store.reserve(scope, "k", FP) for _ in range(20)))
    kinds = [x.kind for x in decisions]
    assert kinds.count(DecisionKind.EXECUTE) == 1
    assert kinds.count(DecisionKind.IN_PROGRESS) == 19
    winner = next(x for x in decisions if x.kind is DecisionKind.EXECUTE)
    assert winner.record.attempts == 2


async def test_expired_lease_is_never_re_executed(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    await store.reserve(scope, "k", FP)
    await expire_lease(pg_pool, store, scope, "k")
    decision = await store.reserve(scope, "k", FP)
    assert decision.kind is DecisionKind.UNKNOWN
    assert decision.zombie
    assert decision.record.last_error == "lease_expired"
    assert store.metrics.count("zombie", scope) == 1
    # and it stays blocked until reconciled
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.UNKNOWN


async def test_sweep_parks_expired_leases_only(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    await store.reserve(scope, "dead", FP)
    await store.reserve(scope, "alive", FP)
    await expire_lease(pg_pool, store, scope, "dead")
    parked = await store.sweep()
    assert parked >= 1
    dead, alive = await store.get(scope, "dead"), await store.get(scope, "alive")
    assert dead is not None and dead.status is Status.UNKNOWN and dead.reconcile_after is not None
    assert alive is not None and alive.status is Status.IN_PROGRESS


async def test_fencing_after_lease_loss(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    d = await store.reserve(scope, "k", FP)
    await expire_lease(pg_pool, store, scope, "k")
    await store.sweep()
    with pytest.raises(LeaseLost):
        await store.complete(scope, "k", d.token, {"late": True})
    with pytest.raises(LeaseLost):
        await store.fail_retryable(scope, "k", d.token)
    with pytest.raises(LeaseLost):
        await store.mark_unknown(scope, "k", d.token)
    with pytest.raises(LeaseLost):
        await store.evict(scope, "k", token=d.token)
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN and record.result is None


async def test_a_stale_owner_cannot_touch_the_new_owners_attempt(
    store: PostgresStore, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.fail_retryable(scope, "k", first.token)
    second = await store.reserve(scope, "k", FP)
    assert second.kind is DecisionKind.EXECUTE
    with pytest.raises(LeaseLost):
        await store.complete(scope, "k", first.token, "stale")
    await store.complete(scope, "k", second.token, "fresh")
    assert (await store.reserve(scope, "k", FP)).record.result == "fresh"


async def test_resolve_paths(store: PostgresStore, scope: str) -> None:
    for key in ("yes", "no"):
        d = await store.reserve(scope, key, FP)
        await store.mark_unknown(scope, key, d.token, "gateway timeout")
    done = await store.resolve(scope, "yes", Executed({"charge": "ch_1"}))
    assert done.status is Status.COMPLETED
    assert (await store.reserve(scope, "yes", FP)).record.result == {"charge": "ch_1"}
    back = await store.resolve(scope, "no", NotExecuted())
    assert back.status is Status.FAILED_RETRYABLE
    again = await store.reserve(scope, "no", FP)
    assert again.kind is DecisionKind.EXECUTE and again.record.attempts == 2
    with pytest.raises(NotUnknown):
        await store.resolve(scope, "yes", NotExecuted())


async def test_evict_by_operator(store: PostgresStore, scope: str) -> None:
    d = await store.reserve(scope, "k", FP)
    await store.complete(scope, "k", d.token, 1)
    assert await store.evict(scope, "k") is True
    assert await store.get(scope, "k") is None
    assert await store.evict(scope, "k") is False
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.EXECUTE


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


async def test_unmigrated_schema_is_store_unavailable(pg_pool: asyncpg.Pool) -> None:
    with pytest.raises(StoreUnavailable, match="reserve"):
        await PostgresStore(pg_pool, schema="never_migrated").reserve("s", "k", FP)


def test_schema_name_is_validated(pg_pool: asyncpg.Pool) -> None:
    with pytest.raises(ValueError, match="invalid schema"):
        PostgresStore(pg_pool, schema='x"; drop table y; --')
