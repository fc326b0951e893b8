"""Two-phase mode: every branch survives a lost lease or an evicted key, and I/O errors after
the call started are ambiguous, never retried blindly.

Each test names the mistake it exists to catch."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Action,
    Attempt,
    ConsumerMessage,
    DecisionKind,
    OutcomeKind,
    PoisonMessage,
    PostgresStore,
    Retryable,
    Status,
    idempotent_consumer,
    run_two_phase,
)
from tests import _core_units
from tests._core_units import FP, msg

ledger = _core_units.ledger  # a fixture: the effect table


async def test_two_phase_retryable_after_the_lease_was_lost_settles(
    store: PostgresStore, scope: str
) -> None:
    async def slow_then_refused(attempt: Attempt) -> Any:
        await asyncio.sleep(0.4)
        await store.maintenance.sweep()  # the lease expired meanwhile: the sweeper parks it
        raise Retryable("refused")

    outcome = await run_two_phase(store, scope, "k", FP, slow_then_refused, lease=0.2)
    assert outcome.kind is OutcomeKind.UNKNOWN  # what the record says now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN

    @idempotent_consumer(store, scope=scope, mode="two_phase", lease=0.2)
    async def handler(message: ConsumerMessage, attempt: Attempt) -> Any:
        await asyncio.sleep(0.4)
        await store.maintenance.sweep()
        raise Retryable("refused")

    verdict = await handler.process(msg("k2", {"n": 1}))
    assert verdict.action is Action.ACK and not verdict.reconcile  # the sweeper announced it


@pytest.mark.parametrize("error", [TimeoutError, ConnectionError, ConnectionResetError, OSError])
async def test_two_phase_builtin_io_errors_after_the_call_started_are_unknown(
    store: PostgresStore, scope: str, error: type[Exception]
) -> None:
    """A read timeout or a reset after the request went out may have charged: never retried."""

    async def call(attempt: Attempt) -> Any:
        raise error("after sending")

    outcome = await run_two_phase(store, scope, "k", FP, call)
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.UNKNOWN


async def test_two_phase_local_writes_that_swallow_an_error_do_not_complete(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 0)", scope)

    async def charge(attempt: Attempt) -> Any:
        return {"charged": True}

    async def local(conn: asyncpg.Connection, result: Any) -> None:
        with contextlib.suppress(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 1)", scope)

    outcome = await run_two_phase(store, scope, "k", FP, charge, local_writes=local)
    # the charge happened, its local record did not commit: parked, reconciled, never "done"
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN


async def test_a_two_phase_key_evicted_while_its_call_ran_is_never_run_again(
    store: PostgresStore, scope: str
) -> None:
    charges = 0

    @idempotent_consumer(store, scope=scope, mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal charges
        charges += 1
        # forced under the running call (store.evict refuses a held key: KeyHeld)
        await store.evict_record(scope, "k", while_held=True)
        return {"charged": True}

    first = await charge.process(msg("k", {"n": 1}))
    again = await charge.process(msg("k", {"n": 1}))
    assert charges == 1
    assert first.action is Action.ACK and first.reconcile  # parked with a notice
    assert again.action is Action.ACK and again.duplicate
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN


async def test_a_two_phase_poison_message_is_dead_lettered_not_parked(
    store: PostgresStore, scope: str
) -> None:
    charged: list[int] = []

    @idempotent_consumer(store, scope=scope, mode="two_phase", backoff=(0.01, 0.05))
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        amount = message.json().get("amount")
        if amount is None:  # refused before the gateway is called
            raise PoisonMessage("amount_missing", "no amount")
        charged.append(amount)
        return {"charged": amount}

    verdict = await charge.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "amount_missing", verdict
    assert not verdict.reconcile
    assert await store.get(scope, "k") is None  # the key is free again
    corrected = await charge.process(msg("k", {"amount": 5}))
    assert corrected.action is Action.ACK and charged == [5]
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.COMPLETED
