"""What a RabbitMQ delivery says about itself: its view for the consumer, the deliveries it has
spent, whether it was delivered before, and whether an error means its channel is gone."""

from __future__ import annotations

import aiormq
from aio_pika.abc import AbstractIncomingMessage

from consumer_idem.message import ConsumerMessage, header_bytes

#: on a copy handed back after a long wait: the deliveries its original had already spent
SPENT_DELIVERIES = "x-consumer-idem-deliveries"


def to_message(message: AbstractIncomingMessage) -> ConsumerMessage:
    headers = {k: header_bytes(v) for k, v in (message.headers or {}).items() if v is not None}
    count = headers.get("x-delivery-count")
    return ConsumerMessage(
        body=message.body,
        headers=headers,
        message_id=message.message_id,
        delivery_count=int(count) if count and count.isdigit() else None,
        content_type=message.content_type,
        raw=message,
    )


def spent_deliveries(message: ConsumerMessage) -> int | None:
    """Deliveries of this message that counted: the broker's ``x-delivery-count`` plus what a
    handed-back copy carries over from its original."""
    carried = message.headers.get(SPENT_DELIVERIES)
    extra = int(carried) if carried and carried.isdigit() else 0
    if message.delivery_count is None and not extra:
        return None
    return (message.delivery_count or 0) + extra


def redelivered_before(message: AbstractIncomingMessage) -> bool:
    """Delivered before (maybe what killed the last consumer): it runs alone, and counts."""
    return bool(message.redelivered or spent_deliveries(to_message(message)))


def lost(exc: BaseException) -> bool:
    """A lost channel or connection: routine (a broker restart), logged without a traceback."""
    return isinstance(
        exc,
        aiormq.exceptions.AMQPError | aiormq.exceptions.ChannelInvalidStateError | ConnectionError,
    )
