"""One suite, two stores: PostgresStore and RedisStore make the same decisions.

Leases expire in real time here (short leases), the same way for both stores.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    Ambiguous,
    Attempt,
    DecisionKind,
    DomainError,
    Executed,
    KeyHeld,
    LeaseLost,
    NotExecuted,
    NotUnknown,
    OutcomeKind,
    PostgresStore,
    ResultKind,
    Retryable,
    Status,
    StoredResponse,
    run_two_phase,
)
from consumer_idem.stores.redis import RedisStore

FP = "v1:jcs:aaa"
OTHER_FP = "v1:jcs:bbb"
SHORT = 0.3  # lease seconds for the expiry tests


@pytest.fixture(params=["postgres", "redis"])
async def any_store(
    request: pytest.FixtureRequest,
    store: PostgresStore,
    redis_client: aioredis.Redis,
    redis_prefix: str,
) -> Any:
    if request.param == "postgres":
        return store
    return RedisStore(redis_client, prefix=redis_prefix)


async def sweep(any_store: Any) -> int:
    """One sweep; returns the leases parked (Postgres sweeps through its maintenance part)."""
    if isinstance(any_store, PostgresStore):
        return (await any_store.maintenance.sweep()).parked
    parked: int = await any_store.sweep()
    return parked


async def test_execute_complete_then_replay_byte_identical(any_store: Any, scope: str) -> None:
    first = await any_store.reserve(scope, "k1", FP)
    assert first.kind is DecisionKind.EXECUTE and first.record.attempts == 1
    result = {"z": 1, "a": [1.5, "é"], "m": None}
    response = StoredResponse(201, {"content-type": "application/json"}, b'{"id": 1}\n\x00\xff')
    done = await any_store.complete(scope, "k1", first.token, result, response=response)
    assert done.status is Status.COMPLETED
    again = await any_store.reserve(scope, "k1", FP)
    assert again.kind is DecisionKind.REPLAY
    assert again.record.result_json == '{"z":1,"a":[1.5,"é"],"m":null}'
    assert again.record.result == result and again.record.response == response
    assert again.record.result_kind is ResultKind.SUCCESS


async def test_in_progress_elsewhere_has_a_retry_after(any_store: Any, scope: str) -> None:
    await any_store.reserve(scope, "k", FP, lease=20)
    other = await any_store.reserve(scope, "k", FP)
    assert other.kind is DecisionKind.IN_PROGRESS and 10 < other.retry_after <= 20


@pytest.mark.parametrize("state", ["in_progress", "completed", "failed_retryable", "unknown"])
async def test_misuse_in_every_state(any_store: Any, scope: str, state: str) -> None:
    d = await any_store.reserve(scope, "k", FP)
    if state == "completed":
        await any_store.complete(scope, "k", d.token, {"ok": True})
    elif state == "failed_retryable":
        await any_store.fail_retryable(scope, "k", d.token)
    elif state == "unknown":
        await any_store.mark_unknown(scope, "k", d.token)
    misuse = await any_store.reserve(scope, "k", OTHER_FP)
    assert misuse.kind is DecisionKind.MISUSE and misuse.record.status == state


async def test_failed_retryable_is_reacquired_by_exactly_one_racer(
    any_store: Any, scope: str
) -> None:
    d = await any_store.reserve(scope, "k", FP)
    await any_store.fail_retryable(scope, "k", d.token, "connect refused")
    decisions = await asyncio.gather(*(any_store.reserve(scope, "k", FP) for _ in range(20)))
    kinds = [x.kind for x in decisions]
    assert kinds.count(DecisionKind.EXECUTE) == 1
    assert kinds.count(DecisionKind.IN_PROGRESS) == 19
    assert next(x for x in decisions if x.kind is DecisionKind.EXECUTE).record.attempts == 2


async def test_fifty_concurrent_reservers_one_executes(any_store: Any, scope: str) -> None:
    decisions = await asyncio.gather(*(any_store.reserve(scope, "hot", FP) for _ in range(50)))
    kinds = [x.kind for x in decisions]
    assert kinds.count(DecisionKind.EXECUTE) == 1 and kinds.count(DecisionKind.IN_PROGRESS) == 49


async def test_an_expired_lease_is_never_re_executed(any_store: Any, scope: str) -> None:
    await any_store.reserve(scope, "k", FP, lease=SHORT)
    await asyncio.sleep(SHORT + 0.2)
    decision = await any_store.reserve(scope, "k", FP)
    assert decision.kind is DecisionKind.UNKNOWN and decision.zombie
    assert decision.record.last_error == "lease_expired"
    assert (await any_store.reserve(scope, "k", FP)).kind is DecisionKind.UNKNOWN
    assert any_store.metrics.count("zombie", scope) == 1


async def test_sweep_parks_expired_leases_only(any_store: Any, scope: str) -> None:
    await any_store.reserve(scope, "dead", FP, lease=SHORT)
    await any_store.reserve(scope, "alive", FP, lease=60)
    await asyncio.sleep(SHORT + 0.2)
    assert await sweep(any_store) >= 1
    dead, alive = await any_store.get(scope, "dead"), await any_store.get(scope, "alive")
    assert dead.status is Status.UNKNOWN and dead.reconcile_after is not None
    assert alive.status is Status.IN_PROGRESS


async def test_fencing_after_lease_loss(any_store: Any, scope: str) -> None:
    d = await any_store.reserve(scope, "k", FP, lease=SHORT)
    await asyncio.sleep(SHORT + 0.2)
    await sweep(any_store)
    for late in (
        any_store.complete(scope, "k", d.token, {"late": True}),
        any_store.fail_retryable(scope, "k", d.token),
        any_store.mark_unknown(scope, "k", d.token),
        any_store.evict(scope, "k", token=d.token),
    ):
        with pytest.raises(LeaseLost):
            await late
    record = await any_store.get(scope, "k")
    assert record.status is Status.UNKNOWN and record.result is None


async def test_a_stale_owner_cannot_touch_the_new_attempt(any_store: Any, scope: str) -> None:
    first = await any_store.reserve(scope, "k", FP)
    await any_store.fail_retryable(scope, "k", first.token)
    second = await any_store.reserve(scope, "k", FP)
    assert second.kind is DecisionKind.EXECUTE
    with pytest.raises(LeaseLost):
        await any_store.complete(scope, "k", first.token, "stale")
    await any_store.complete(scope, "k", second.token, "fresh")
    assert (await any_store.reserve(scope, "k", FP)).record.result == "fresh"


async def test_resolve_paths(any_store: Any, scope: str) -> None:
    for key in ("yes", "no"):
        d = await any_store.reserve(scope, key, FP)
        await any_store.mark_unknown(scope, key, d.token, "gateway timeout")
    done = await any_store.resolve(scope, "yes", Executed({"charge": "ch_1"}))
    assert done.status is Status.COMPLETED
    assert (await any_store.reserve(scope, "yes", FP)).record.result == {"charge": "ch_1"}
    back = await any_store.resolve(scope, "no", NotExecuted())
    assert back.status is Status.FAILED_RETRYABLE
    again = await any_store.reserve(scope, "no", FP)
    assert again.kind is DecisionKind.EXECUTE and again.record.attempts == 2
    with pytest.raises(NotUnknown):
        await any_store.resolve(scope, "yes", NotExecuted())


async def test_evict_by_operator(any_store: Any, scope: str) -> None:
    d = await any_store.reserve(scope, "k", FP)
    await any_store.complete(scope, "k", d.token, 1)
    assert await any_store.evict(scope, "k") is True
    assert await any_store.get(scope, "k") is None
    assert await any_store.evict(scope, "k") is False
    assert (await any_store.reserve(scope, "k", FP)).kind is DecisionKind.EXECUTE


async def test_an_operator_evict_refuses_a_key_a_worker_holds(any_store: Any, scope: str) -> None:
    """Deleted under a running call, a duplicate delivered before the call ends would run it
    again: an operator's evict (no token) of a held key raises ``KeyHeld`` and changes nothing,
    in every store."""
    held = await any_store.reserve(scope, "k", FP, lease=60)
    with pytest.raises(KeyHeld) as refused:
        await any_store.evict(scope, "k")
    assert refused.value.held_until > datetime.now(UTC)
    assert (await any_store.reserve(scope, "k", FP)).kind is DecisionKind.IN_PROGRESS
    await any_store.complete(scope, "k", held.token, 1)
    assert await any_store.evict(scope, "k") is True


async def test_two_phase_execution_classifies_the_same(any_store: Any, scope: str) -> None:
    async def refused(attempt: Attempt) -> Any:
        raise Retryable("not sent")

    async def timed_out(attempt: Attempt) -> Any:
        raise Ambiguous("sent, no answer")

    async def declined(attempt: Attempt) -> Any:
        raise DomainError({"declined": True})

    async def ok(attempt: Attempt) -> Any:
        return {"charged": attempt.key}

    assert (await run_two_phase(any_store, scope, "a", FP, refused)).kind is (
        OutcomeKind.FAILED_RETRYABLE
    )
    assert (await run_two_phase(any_store, scope, "a", FP, ok)).attempts == 2
    assert (await run_two_phase(any_store, scope, "a", FP, ok)).kind is OutcomeKind.REPLAYED
    assert (await run_two_phase(any_store, scope, "b", FP, timed_out)).kind is OutcomeKind.UNKNOWN
    domain = await run_two_phase(any_store, scope, "c", FP, declined)
    assert domain.result_kind is ResultKind.DOMAIN_ERROR
    assert (await run_two_phase(any_store, scope, "c", FP, ok)).result == {"declined": True}
