"""The reconciler's NotExecuted path under injected faults, against the real Postgres.

Invariant: once the resolver said "not executed", the original message is re-dispatched, whatever
fails in between (a re-dispatch that is refused, raises, or is cut short by a stopping runner; a
crash right after the row was resolved). Recovery is what production does: the broker delivers an
unacked notice again, and the sweeper runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from consumer_idem import ConsumerMessage, NotExecuted, PostgresStore, Status
from consumer_idem.notice import Notice, encode_notice
from consumer_idem.operations.reconcile import Reconciler, Sweeper
from consumer_idem.types import Record

ORIGINAL = ConsumerMessage(b'{"amount": 7}', {"idempotency-key": b"pay-1", "trace": b"\xff\x00"})


class FakeTransport:
    """A transport whose re-dispatch misbehaves as told: ``ok``, ``refused`` (returns False, as
    a stopping runner does), ``raises``, or ``hangs`` (never returns: the crash case)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.redispatched: list[Notice] = []
        self.notices: list[tuple[str, str, bytes]] = []

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        self.notices.append((scope, key, body))
        return True

    async def redispatch(self, notice: Notice) -> bool:
        if self.mode == "refused":
            return False
        if self.mode == "raises":
            raise RuntimeError("broker said no")
        if self.mode == "hangs":
            await asyncio.Event().wait()
        self.redispatched.append(notice)
        return True


async def parked(store: PostgresStore, scope: str, key: str = "pay-1") -> bytes:
    """An ``unknown`` row and the notice its delivery published (with the original message)."""
    decision = await store.reserve(scope, key, "v1:fp")
    assert decision.token is not None
    await store.mark_unknown(scope, key, decision.token, "read timeout")
    return encode_notice(scope, key, "read timeout", source="payments", original=ORIGINAL)


async def no_charge(record: Record) -> Any:
    return NotExecuted("gateway: no charge")


async def later(store: PostgresStore, scope: str) -> None:
    """Time passes: every outbox row of ``scope`` is due (its backoff is over)."""
    await store.pool.execute(
        f'UPDATE "{store.schema}".redispatch_outbox SET due_at = now() WHERE scope = $1', scope
    )


async def recover(store: PostgresStore, scope: str, notice: bytes, acked: bool) -> FakeTransport:
    """After the fault: the broker redelivers the notice if it was not acked, and, once its
    backoff is over, the sweeper runs. Returns the healthy transport both used."""
    healthy = FakeTransport()
    reconciler = Reconciler(store, no_charge, scopes=[scope])
    reconciler.attach(healthy)
    if not acked:
        await reconciler.process(ConsumerMessage(notice))
    await later(store, scope)
    await Sweeper(store, healthy, scopes=[scope]).run_once()
    return healthy


def assert_redispatched(transport: FakeTransport) -> None:
    assert transport.redispatched, "the original message was never re-dispatched: work lost"
    sent = transport.redispatched[0]
    assert (sent.source, sent.body) == ("payments", ORIGINAL.body)
    assert sent.headers == ORIGINAL.headers


@pytest.mark.parametrize("mode", ["refused", "raises"])
async def test_a_redispatch_that_does_not_go_out_is_not_lost(
    store: PostgresStore, scope: str, mode: str
) -> None:
    notice = await parked(store, scope)
    reconciler = Reconciler(store, no_charge, redispatch_grace=0)
    reconciler.attach(FakeTransport(mode))
    acked = False
    try:
        verdict = await reconciler.process(ConsumerMessage(notice))
        acked = verdict.action.value == "ack"
    except RuntimeError:
        pass  # the runner's worker died: the notice is not acked, it comes again
    healthy = await recover(store, scope, notice, acked)
    assert_redispatched(healthy)
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.FAILED_RETRYABLE


async def test_a_crash_right_after_the_resolution_does_not_lose_the_work(
    store: PostgresStore, scope: str
) -> None:
    notice = await parked(store, scope)
    reconciler = Reconciler(store, no_charge, redispatch_grace=0)
    reconciler.attach(FakeTransport("hangs"))
    task = asyncio.create_task(reconciler.process(ConsumerMessage(notice)))

    async def resolved() -> bool:
        record = await store.get(scope, "pay-1")
        return record is not None and record.status is not Status.UNKNOWN

    for _ in range(100):
        if await resolved():
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    task.cancel()  # the process dies here: nothing after this point runs; the notice is unacked
    with pytest.raises(asyncio.CancelledError):
        await task
    healthy = await recover(store, scope, notice, acked=False)
    assert_redispatched(healthy)


async def test_a_sent_redispatch_is_not_sent_again_by_the_sweeper(
    store: PostgresStore, scope: str
) -> None:
    notice = await parked(store, scope)
    transport = FakeTransport()
    reconciler = Reconciler(store, no_charge, redispatch_grace=0)
    reconciler.attach(transport)
    verdict = await reconciler.process(ConsumerMessage(notice))
    assert verdict.action.value == "ack" and len(transport.redispatched) == 1
    report = await Sweeper(store, transport, scopes=[scope]).run_once()
    assert report.redispatched == 0 and len(transport.redispatched) == 1


async def test_the_sweeper_retries_a_failing_redispatch_with_backoff(
    store: PostgresStore, scope: str
) -> None:
    await parked(store, scope)
    notice = encode_notice(scope, "pay-1", "read timeout", source="payments", original=ORIGINAL)
    reconciler = Reconciler(store, no_charge, redispatch_grace=0)
    reconciler.attach(FakeTransport("raises"))
    await reconciler.process(ConsumerMessage(notice))
    failing = FakeTransport("raises")
    report = await Sweeper(store, failing, scopes=[scope]).run_once()
    assert report.redispatched == 0
    (pending,) = await store.redispatch.pending_redispatches(scopes=[scope], due_only=False)
    assert pending.attempts >= 1 and "broker said no" in (pending.last_error or "")
    # not due again at once: the sweeper backs off
    assert await store.redispatch.pending_redispatches(scopes=[scope]) == []
    await later(store, scope)
    healthy = FakeTransport()
    report = await Sweeper(store, healthy, scopes=[scope]).run_once()
    assert report.redispatched == 1 and healthy.redispatched[0].body == ORIGINAL.body
    assert await store.redispatch.pending_redispatches(scopes=[scope], due_only=False) == []


async def test_a_notice_without_the_original_message_resolves_without_an_outbox_row(
    store: PostgresStore, scope: str
) -> None:
    await parked(store, scope)
    bare = encode_notice(scope, "pay-1", "lease_expired")
    transport = FakeTransport()
    reconciler = Reconciler(store, no_charge)
    reconciler.attach(transport)
    verdict = await reconciler.process(ConsumerMessage(bare))
    assert verdict.action.value == "ack" and transport.redispatched == []
    assert await store.redispatch.pending_redispatches(scopes=[scope], due_only=False) == []
