"""Re-acquiring a key: of several reservers queued on a ``failed_retryable`` row exactly one
executes, a cached store runs a key resolved "not executed" again, and a key parked again
after an evict re-dispatches its new original.

Each test names the mistake it exists to catch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    CompletedCache,
    DecisionKind,
    NotExecuted,
    PostgresStore,
    Status,
)
from consumer_idem.notice import make_notice
from tests import _core_units
from tests._core_units import FP, msg

ledger = _core_units.ledger  # a fixture: the effect table


async def test_reservers_queued_on_a_failed_retryable_row_yield_exactly_one_execute(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.fail_retryable(scope, "k", first.token)
    async with pg_pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(
            f"SELECT 1 FROM {store.table} WHERE scope = $1 AND key = $2 FOR UPDATE", scope, "k"
        )
        racers = [asyncio.create_task(store.reserve(scope, "k", FP)) for _ in range(6)]
        await asyncio.sleep(0.5)  # every racer is now queued on the row lock
        assert not any(t.done() for t in racers)
        await tx.rollback()
        decisions = await asyncio.gather(*racers)
    kinds = sorted(d.kind for d in decisions)
    assert kinds.count(DecisionKind.EXECUTE) == 1, kinds
    assert set(kinds) == {DecisionKind.EXECUTE, DecisionKind.IN_PROGRESS}


@pytest.fixture
async def cached(
    pg_pool: asyncpg.Pool, redis_client: aioredis.Redis, redis_prefix: str
) -> AsyncIterator[PostgresStore]:
    yield PostgresStore(pg_pool, cache=CompletedCache(redis_client, prefix=redis_prefix))


async def test_a_key_resolved_not_executed_through_a_cached_store_runs_again(
    cached: PostgresStore, scope: str
) -> None:
    first = await cached.reserve(scope, "k", FP)
    await cached.mark_unknown(scope, "k", first.token)
    resolved = await cached.resolve(scope, "k", NotExecuted("gateway has no such charge"))
    assert resolved.status is Status.FAILED_RETRYABLE
    assert (await cached.reserve(scope, "k", FP)).kind is DecisionKind.EXECUTE


async def test_a_key_parked_again_after_an_evict_redispatches_its_new_original(
    store: PostgresStore, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.mark_unknown(scope, "k", first.token)
    old = make_notice(scope, "k", "timeout", source="orders", original=msg("k", {"amount": 1}))
    assert await store.redispatch.keep_original(scope, "k", old) is Status.UNKNOWN
    # an operator evicts (the old original is armed), and the same key comes with another body
    await store.evict(scope, "k")
    second = await store.reserve(scope, "k", FP)
    await store.mark_unknown(scope, "k", second.token)
    new = make_notice(scope, "k", "timeout", source="orders", original=msg("k", {"amount": 2}))
    assert await store.redispatch.keep_original(scope, "k", new) is Status.UNKNOWN
    armed = await store.reconciliation.resolve_not_executed(
        scope, "k", NotExecuted("no charge"), due_in=0
    )
    assert armed is not None and json.loads(armed.notice.body or b"") == {"amount": 2}
