"""Publishing to RabbitMQ: which publish errors are permanent, and the sender of the
transactional outbox (`RabbitOutboxSender`). ``RabbitRunner`` publishes its outgoing
messages through this sender and judges its dead-letter and notice publishes by the same
errors."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq

from consumer_idem.outbox import OutgoingMessage, send_all
from consumer_idem.outbox_identity import amqp_where, broker_route

#: the arguments of the queues declared when none are given
QUORUM = {"x-queue-type": "quorum"}


def permanent(exc: BaseException) -> bool:
    """A publish error that recurs for the same message and queue. A refused publish (full
    queue with ``reject-publish``: a nack) and an unroutable one (no such queue yet) are
    transient: holding the delivery until it goes through is right, and a copy without its
    body would fare no better."""
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        return "size" in str(exc)  # "message size N is larger than configured max size M"
    return isinstance(exc, TypeError | ValueError)  # a header the client cannot encode


def outgoing_message(message: OutgoingMessage) -> aio_pika.Message:
    """An outgoing message of the outbox as AMQP: persistent, its headers (text ones as text),
    its ``idempotency-key`` also as ``message_id`` (for ``amqp_message_id()`` key strategies),
    ``content-type`` also as the property."""
    headers: dict[str, Any] = {}
    for name, value in message.headers:
        try:
            headers[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            headers[name] = bytearray(value)
    content_type = message.header("content-type")
    return aio_pika.Message(
        message.body,
        headers=headers,
        message_id=message.idempotency_key,
        content_type=None if content_type is None else content_type.decode("latin-1"),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


class RabbitOutboxSender:
    """Sends outgoing messages of the transactional outbox (``consumer_idem.outbox``) on a
    channel of its own (publisher confirms, mandatory) of ``connection`` (an aio-pika
    connection, or a callable returning the current one): the destination is a queue, reached
    through the default exchange. With ``declare`` each destination queue is declared once
    (durable, ``queue_arguments``; default: quorum), so a message is never returned for want
    of its queue; a queue that exists with other arguments is taken as it is.

    Messages of one unit to one queue go one after the other (a queue keeps the order of one
    channel's publishes); the others go side by side, each confirmed.

    ``broker``: the broker reached (an AMQP URL, credentials are left out, or a name of
    yours; default: the URL of ``connection`` when it is a connection). The sender's ``route``
    (``amqp:<host:port>[/<vhost>]``) is recorded with each outgoing message, and a relay with this
    sender sends only messages of that route."""

    def __init__(
        self,
        connection: Any,
        *,
        declare: bool = True,
        queue_arguments: dict[str, Any] | None = None,
        concurrency: int = 256,
        broker: str | None = None,
    ) -> None:
        if broker is None and not callable(connection):
            broker = str(getattr(connection, "url", "") or "") or None
        self.route = broker_route("amqp", amqp_where(broker))
        self._connection_source = connection if callable(connection) else lambda: connection
        self.declare = declare
        self.queue_arguments = QUORUM if queue_arguments is None else queue_arguments
        self.concurrency = concurrency
        self._channel: Any = None
        self._owner: Any = None  # the connection the channel was opened on
        self._declared: set[str] = set()

    def permanent(self, exc: BaseException) -> bool:
        return permanent(exc)

    async def _open(self) -> Any:
        connection = self._connection_source()
        if connection is None:
            raise aiormq.exceptions.ChannelInvalidStateError("not connected")
        if self._channel is None or self._channel.is_closed or self._owner is not connection:
            self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self._owner = connection
        return self._channel

    async def _declare_queue(self, name: str) -> None:
        if not self.declare or name in self._declared:
            return
        connection = self._connection_source()
        if connection is None:
            raise aiormq.exceptions.ChannelInvalidStateError("not connected")
        # a channel of its own: a refused declaration closes the channel it was made on
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, durable=True, arguments=self.queue_arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            pass  # it exists, declared otherwise: publish to it as it is
        finally:
            with contextlib.suppress(Exception):
                await channel.close()
        self._declared.add(name)

    async def _send(self, message: OutgoingMessage) -> None:
        await self._declare_queue(message.destination)
        channel = await self._open()
        await channel.default_exchange.publish(
            outgoing_message(message), routing_key=message.destination, mandatory=True
        )

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        return await send_all(self._send, messages, self.permanent, self.concurrency)
