"""A broker in memory: deliver a message until a verdict settles it, and check the promises.

* [`deliver`][consumer_idem.testing.broker.deliver] plays a broker: it hands one message to a
processor (an
  [`IdempotentConsumer`][consumer_idem.IdempotentConsumer]) until the verdict is final, redelivering
  after
  ``retry`` verdicts and after a simulated crash between the commit and the ack, and records
  what a transport would have done (acks, dead letters, notices).
* [`check_invariants`][consumer_idem.testing.broker.check_invariants] asserts the three promises for
one message: nothing acked without a
  durable effect, dead letter or notice; the effect at most once; every message ends executed
  once, dead-lettered with a reason, or ``unknown`` with a notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from consumer_idem.consumer import Action, Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice


class PublishFailed(Exception):
    """An injected publish failure the broker would not repeat (a timeout, a leader change)."""


class PublishRefusedForGood(Exception):
    """An injected publish refusal that every retry meets (a message too large for the topic)."""


@dataclass
class Delivery:
    """What happened to one message, as a transport would have carried it out."""

    message: ConsumerMessage
    verdicts: list[Verdict] = field(default_factory=list)
    acked: bool = False
    dead_letter_reason: str | None = None
    #: the dead-letter copy went out without its body (it was refused whole for good)
    body_dropped: bool = False
    notices: int = 0
    deliveries: int = 0
    crashes: int = 0

    @property
    def final(self) -> Verdict | None:
        return self.verdicts[-1] if self.verdicts else None


class MemoryTransport:
    """A broker in memory, for [`deliver`][consumer_idem.testing.broker.deliver]: it implements the
    settle path's transport
    contract (`consumer_idem.transports.settle.Transport`), so deliveries are carried out
    by the same `settle` as on Kafka and RabbitMQ.
    ``publish_faults`` are raised by the next publishes, one each (``None`` lets one through):
    [`PublishFailed`][consumer_idem.testing.broker.PublishFailed] is transient,
    [`PublishRefusedForGood`][consumer_idem.testing.broker.PublishRefusedForGood] permanent. An ack
    of a
    delivery whose dead letter or notice was not confirmed first fails the test on the spot."""

    def __init__(self, store: Any, *, publish_faults: Sequence[BaseException | None] = ()) -> None:
        from consumer_idem.transports.settle import RunnerStats

        self._store = store
        self.publish_faults = list(publish_faults)
        self.stats = RunnerStats()
        #: every step, in order: "published dead letter k", "ack k", "refused notice k" ...
        self.events: list[str] = []
        self.redispatched: list[Notice] = []
        self._confirmed: set[int] = set()  # deliveries whose publish the broker confirmed
        self._waiting_notice: list[Delivery] = []  # the delivery a notice being sent is for

    @property
    def store(self) -> Any:
        return self._store

    def stopping(self) -> bool:
        return False

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PublishRefusedForGood)

    async def _publish(self, what: str) -> None:
        fault = self.publish_faults.pop(0) if self.publish_faults else None
        if fault is not None:
            self.events.append(f"refused {what}")
            raise fault
        self.events.append(f"published {what}")

    async def ack(self, delivery: Delivery) -> None:
        verdict = delivery.final
        needs_publish = verdict is not None and (
            verdict.action is Action.DEAD_LETTER or verdict.reconcile
        )
        if needs_publish and id(delivery) not in self._confirmed:
            raise AssertionError(f"acked before its dead letter or notice was confirmed: {verdict}")
        self.events.append(f"ack {delivery.message.header('idempotency-key')!r}")
        delivery.acked = True

    async def retry_later(self, delivery: Delivery, verdict: Verdict) -> None:
        self.events.append(f"retry {verdict.key}")

    async def give_back(self, delivery: Delivery) -> None:
        self.events.append(f"give back {delivery.final}")

    def dead_letter_destination(self, delivery: Delivery) -> str:
        return "dead-letters"

    def body_size(self, delivery: Delivery) -> int:
        return len(delivery.message.body)

    async def send_dead_letter(
        self, delivery: Delivery, verdict: Verdict, body_dropped: bool
    ) -> None:
        await self._publish(f"dead letter {verdict.key}")
        delivery.dead_letter_reason = verdict.reason or "unknown"
        delivery.body_dropped = body_dropped
        self._confirmed.add(id(delivery))

    def notice_body(self, delivery: Delivery, verdict: Verdict, with_original: bool) -> bytes:
        from consumer_idem.consumer import reconcile_notice

        original = delivery.message if with_original else None
        return reconcile_notice(verdict, original, source="memory" if with_original else None)

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self._publish(f"notice {key}")
        for delivery in self._waiting_notice:
            delivery.notices += 1
            self._confirmed.add(id(delivery))

    async def send_redispatch(self, notice: Notice) -> None:
        await self._publish(f"redispatch {notice.key}")
        self.redispatched.append(notice)

    # what the reconciler and the sweeper use (``settle.Publisher``)
    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        from consumer_idem.transports import settle

        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        from consumer_idem.transports import settle

        return await settle.redispatch(self, notice)


Processor = Callable[[ConsumerMessage], Awaitable[Verdict]]


async def deliver(
    process: Processor,
    message: ConsumerMessage,
    *,
    transport: MemoryTransport | None = None,
    crash_before_ack: int = 0,
    max_deliveries: int = 20,
    retry_cap: float = 0.05,
) -> Delivery:
    """Deliver ``message`` until a verdict settles it, as a broker with at-least-once delivery
    would, carrying each verdict out through `consumer_idem.transports.settle.settle` on
    ``transport`` (a fresh [`MemoryTransport`][consumer_idem.testing.broker.MemoryTransport] by
    default): ``retry`` verdicts, exceptions,
    cancellations and publishes that did not complete are redelivered; the first
    ``crash_before_ack`` settling verdicts are lost before they are carried out (the process
    died after the commit), so the message comes again. Waits ``retry_after`` (at most
    ``retry_cap``) between deliveries."""
    from consumer_idem.transports.settle import Settled, settle

    transport = transport or MemoryTransport(None)
    delivery = Delivery(message)
    while delivery.deliveries < max_deliveries:
        delivery.deliveries += 1
        try:
            verdict = await process(message.fresh())
        except (Exception, asyncio.CancelledError):
            delivery.crashes += 1  # the worker died with the delivery unsettled
            continue
        delivery.verdicts.append(verdict)
        if verdict.action is not Action.RETRY and crash_before_ack > 0:
            crash_before_ack -= 1
            delivery.crashes += 1
            continue
        transport._waiting_notice = [delivery]
        settled = await settle(transport, delivery, verdict)
        transport._waiting_notice = []
        if settled is Settled.ACKED:
            return delivery
        await asyncio.sleep(min(verdict.retry_after, retry_cap))
    return delivery


BatchProcessor = Callable[[list[ConsumerMessage]], Awaitable[list[Verdict]]]


async def deliver_batch(
    process_batch: BatchProcessor,
    messages: Sequence[ConsumerMessage],
    *,
    transport: MemoryTransport | None = None,
    crash_before_ack: int = 0,
    max_rounds: int = 50,
    retry_cap: float = 0.05,
) -> list[Delivery]:
    """[`deliver`][consumer_idem.testing.broker.deliver] for an ordered run of messages (a Kafka
    partition's fetch), handed to
    ``process_batch`` (``IdempotentConsumer.process_batch``) together: each round delivers the
    run from its first unsettled message, carrying the verdicts out in order until one is not
    acked. The first ``crash_before_ack`` rounds that settled something are lost before they
    are carried out (the process died after the commit)."""
    from consumer_idem.transports.settle import Settled, settle

    transport = transport or MemoryTransport(None)
    deliveries = [Delivery(m) for m in messages]
    done = 0
    for _ in range(max_rounds):
        if done == len(deliveries):
            break
        pending = deliveries[done:]
        for delivery in pending:
            delivery.deliveries += 1
        try:
            verdicts = await process_batch([d.message.fresh() for d in pending])
        except (Exception, asyncio.CancelledError):
            for delivery in pending:
                delivery.crashes += 1  # the worker died with the run unsettled
            continue
        if crash_before_ack > 0 and verdicts and verdicts[0].action is not Action.RETRY:
            crash_before_ack -= 1
            for delivery in pending:
                delivery.crashes += 1
            continue
        for delivery, verdict in zip(pending, verdicts, strict=False):
            delivery.verdicts.append(verdict)
            transport._waiting_notice = [delivery]
            settled = await settle(transport, delivery, verdict)
            transport._waiting_notice = []
            if settled is not Settled.ACKED:
                await asyncio.sleep(min(verdict.retry_after, retry_cap))
                break
            done += 1
    return deliveries


def check_invariants(
    delivery: Delivery,
    *,
    effects: int,
    status: str | None,
    unknown_noticed: bool,
) -> None:
    """The three promises for one delivered message.

    ``effects``: how many times its effect is in the database now; ``status``: its record's
    status (``None`` when there is no record); ``unknown_noticed``: the row will be announced
    without this delivery (it is due for the sweeper, which publishes unpublished notices).
    """
    where = f"{delivery.message!r}: {delivery}"
    # 2. the effect at most once
    assert effects <= 1, f"effect applied {effects} times: {where}"
    # 3. every message ends executed once, dead-lettered with a reason, or unknown with a notice
    assert delivery.acked, f"never settled: {where}"
    if delivery.dead_letter_reason is not None:
        return
    if status == "unknown":
        assert unknown_noticed or delivery.notices, f"unknown without a notice: {where}"
        return
    # 1. acked as done: the effect is durable, with its completed record
    assert status == "completed", f"acked with the record {status}: {where}"
    assert effects == 1, f"acked as done without its effect: {where}"
