"""Delivery budgets (``max_deliveries``) of FastStream's subscribers whose broker says which
deliveries are redeliveries: RabbitMQ (its ``redelivered`` flag), NATS JetStream
(``num_delivered > 1``) and Redis Streams (an entry handed over by a claiming subscriber,
``XAUTOCLAIM``, was pending: delivered before). A transport plugs in with one question,
``delivered_before(message, subscriber)``: did the broker deliver this message before (it may be
what killed the last consumer)? Kafka has no per-record redelivery counter, so no budget: a
record that kills the process is retried until fixed.

The same rule as [`RabbitRunner`][consumer_idem.transports.rabbit.RabbitRunner]'s
(`consumer_idem.transports.delivery_budget`): the broker's ``x-delivery-count`` only says
which deliveries were delivered before. Those run alone in the process (first deliveries
wait, `consumer_idem.transports.run_gate`), each counting one attempt of
its key in Postgres right before its handler; a first delivery counts when its handler fails.
At ``max_deliveries`` attempts the key's record is read first: a completed key is replayed and
acked, never dead-lettered, and a store outage is waited out. So deliveries returned by a
consumer that died without running them (a poison beside them) spend nothing, and an effect
that committed but whose ack kept being lost is not dead-lettered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from consumer_idem.consumer import Verdict
from consumer_idem.errors import ConfigurationError, IdempotencyConfigError
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle
from consumer_idem.transports.delivery_budget import DeliveryBudget, Execute

if TYPE_CHECKING:
    from faststream import StreamMessage

    from consumer_idem.faststream import Idempotency


#: whether the broker delivered a message (through a subscriber) before (a suspect: it runs
#: alone, counted ahead)
DeliveredBefore = Callable[["StreamMessage[Any]", Any], bool]


def rabbit_delivered_before(message: StreamMessage[Any], subscriber: Any) -> bool:
    from consumer_idem.transports.rabbit import redelivered_before

    return redelivered_before(message.raw_message)


class BrokerBudget:
    """The delivery budget of one [`Idempotency`][consumer_idem.faststream.Idempotency] (its
    scope's keys) on a broker that says which deliveries it delivered before."""

    def __init__(self, idem: Idempotency, delivered_before: DeliveredBefore) -> None:
        self.idem = idem
        self.delivered_before = delivered_before
        self._budget: DeliveryBudget | None = None

    @property
    def budget(self) -> DeliveryBudget:
        # built on first use: the consumer itself may be (a store opened on startup)
        if self._budget is None:
            self._budget = DeliveryBudget(self.idem.consumer, self.idem.max_deliveries)
        return self._budget

    def processing(
        self,
        message: StreamMessage[Any],
        subscriber: Any,
        view: Callable[[], ConsumerMessage],
        execute: Execute,
        fresh: Callable[[], Awaitable[Verdict]],
    ) -> Callable[[], Awaitable[Verdict]]:
        """How ``message`` is processed: a first delivery by ``fresh``, beside others but never
        beside a suspect; a delivery the broker delivered before runs counted, alone in its
        process (``view`` gives a fresh view of it per try, ``execute`` runs it once counted)."""
        if not self.delivered_before(message, subscriber):
            return self.budget.fresh(fresh)
        return self.budget.suspect(view, execute)

    async def failed(self, message: StreamMessage[Any], subscriber: Any, verdict: Verdict) -> None:
        """A delivery is handed back for a retry: a first delivery's failed run counts now (a
        redelivered one counted itself ahead; a wait for the store or another owner is no
        run)."""
        if settle.is_wait(verdict) or self.delivered_before(message, subscriber):
            return
        await self.budget.failed(verdict)


class RabbitBudget(BrokerBudget):
    """The delivery budget on a ``RabbitBroker`` (its ``redelivered`` flag)."""

    def __init__(self, idem: Idempotency) -> None:
        super().__init__(idem, rabbit_delivered_before)

    def check_queue(self, subscriber: Any) -> None:
        """Refuse a subscriber whose queue is declared with an ``x-delivery-limit`` below the
        budget (the broker would drop, or dead-letter elsewhere, a message the budget still
        means to deliver), as ``RabbitRunner`` refuses such queue arguments."""
        from consumer_idem.transports.rabbit_limits import check_arguments

        queue = getattr(subscriber, "queue", None)
        arguments = getattr(queue, "arguments", None)
        if not isinstance(arguments, dict):
            return
        try:
            check_arguments(arguments, self.idem.max_deliveries, str(getattr(queue, "name", "")))
        except ConfigurationError as exc:
            raise IdempotencyConfigError(str(exc)) from exc
