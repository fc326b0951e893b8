"""The RabbitMQ side of a FastStream subscriber: acks, requeues, confirmed publishes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from faststream import StreamMessage

from consumer_idem.consumer import (
    Verdict,
)
from consumer_idem.errors import (
    IdempotencyConfigError,
)
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency

log = logging.getLogger("consumer_idem.faststream")


class _Rabbit:
    holds_waits = True

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        self.idem = idem
        self.broker = broker
        self._declared: set[str] = set()

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        from consumer_idem.transports.rabbit import to_message

        raw = message.raw_message
        if not hasattr(raw, "delivery_tag"):
            raise IdempotencyConfigError("a RabbitMQ Idempotency middleware got a non-AMQP message")
        return to_message(raw)

    def check(self, subscriber: Any) -> None:
        """Deliveries are acked one by one: any concurrency is fine. The queue's own delivery
        limit must not end a message before the budget does."""
        from consumer_idem.faststream.budget import RabbitBudget

        assert isinstance(self.idem.budget, RabbitBudget)
        self.idem.budget.check_queue(subscriber)

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        queue = getattr(subscriber, "queue", None)
        name = getattr(queue, "name", None)
        return str(name or message.raw_message.routing_key)

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        from consumer_idem.transports.rabbit import amqp_properties

        return None if incoming.raw is None else amqp_properties(incoming.raw)

    def permanent(self, exc: BaseException) -> bool:
        from consumer_idem.transports.rabbit import permanent

        return permanent(exc)

    async def ack(self, message: StreamMessage[Any]) -> None:
        await message.ack()

    async def retry(self, message: StreamMessage[Any]) -> None:
        await message.nack(requeue=True)  # type: ignore[call-arg]

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        """Publish a copy to hand the delivery back without spending its delivery budget: at
        the tail of the queue, carrying the deliveries already spent (the caller then acks the
        original)."""
        from consumer_idem.transports.rabbit import handed_back_copy, spent_deliveries

        raw = message.raw_message
        copy = handed_back_copy(raw, spent_deliveries(self.incoming(message)))
        await self._send(
            source,
            copy.body,
            dict(copy.headers),
            message_id=copy.message_id,
            correlation_id=copy.correlation_id,
            content_type=copy.content_type,
        )

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None:
        from consumer_idem.transports.rabbit import dead_letter_headers

        raw = message.raw_message
        await self.publish(
            to,
            b"" if body_dropped else raw.body,
            dead_letter_headers(raw, verdict, source, body_dropped),
            message_id=raw.message_id,
            correlation_id=raw.correlation_id,
            content_type=raw.content_type,
        )

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self.publish(
            self.idem.reconcile_destination,
            body,
            {SCOPE_HEADER: scope, KEY_HEADER: key},
            content_type="application/json",
        )

    async def redispatch(self, notice: Notice) -> None:
        """The original as it was: body, headers and properties (``message_id``,
        ``correlation_id``, ``content_type``, ``type``...; FastStream's publish has no
        ``app_id``), as ``RabbitRunner`` re-dispatches it."""
        from consumer_idem.transports.rabbit import redispatch_headers, redispatch_properties

        assert notice.source is not None and notice.body is not None
        properties = redispatch_properties(notice)
        properties.pop("app_id", None)
        if "type" in properties:
            properties["message_type"] = properties.pop("type")
        await self.publish(notice.source, notice.body, redispatch_headers(notice), **properties)

    async def publish(
        self, queue: str, body: bytes, headers: dict[str, Any], **properties: Any
    ) -> None:
        if self.idem.declare and queue not in self._declared:
            from faststream.rabbit import QueueType, RabbitQueue

            # the same declaration as RabbitRunner's: durable quorum queues
            await self.broker.declare_queue(RabbitQueue(queue, queue_type=QueueType.QUORUM))
            self._declared.add(queue)
        await self._send(queue, body, headers, **properties)

    async def _send(
        self, queue: str, body: bytes, headers: dict[str, Any], **properties: Any
    ) -> None:
        import aiormq

        # persistent, mandatory, awaited publisher confirm (FastStream's default channel)
        result = await self.broker.publish(
            body, queue, headers=headers, persist=True, mandatory=True, **properties
        )
        if isinstance(result, aiormq.abc.DeliveredMessage):  # returned: no queue took it
            raise aiormq.exceptions.PublishError(result, result.delivery)
