"""RabbitMQ transport (aio-pika): runs an :class:`IdempotentConsumer` over a queue.

* Ack only after the Postgres commit; at most ``prefetch`` unacked messages are in hand.
* Dead-letter and reconciliation publishes wait for publisher confirms before the ack (one
  settle path, ``consumer_idem.transports.settle``); an unroutable publish is an error, not a
  success.
* Waiting is not failing. A delivery whose store is unavailable, or whose key another consumer
  holds, stays in hand and is processed again after a backoff, for up to ``max_hold`` seconds;
  then it is handed back as a confirmed copy at the tail of its queue (and the original acked),
  which carries its delivery count along. Neither spends the delivery budget.
* A handler failure worth retrying is held for ``retry_after`` seconds and then
  ``nack(requeue=True)``-ed: the prefetch slot, not the whole queue, waits. On quorum queues this
  counts in ``x-delivery-count``; a message delivered ``max_deliveries`` times (it keeps failing
  or killing the consumer) is dead-lettered without running.
* Any unexpected exception while handling a delivery is logged with its traceback, counted in
  ``stats.failures``, and the delivery is ``nack(requeue=True)``-ed after a short backoff: no
  delivery is ever left unsettled in hand.
* ``connect_robust`` reconnects after a broker restart and restores the consumer; unacked
  messages of the lost channel are redelivered and meet their completed records (replays).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from consumer_idem.backoff import Backoff
from consumer_idem.consumer import (
    DEAD_LETTER_ERROR,
    DEAD_LETTER_KEY,
    DEAD_LETTER_REASON,
    DEAD_LETTER_SCOPE,
    Action,
    Processor,
    Verdict,
    reconcile_notice,
)
from consumer_idem.message import ConsumerMessage, header_bytes
from consumer_idem.notice import AMQP_PROPERTIES, KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.notice import ORIGINAL_QUEUE as ORIGINAL_QUEUE
from consumer_idem.settings import load_settings
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle
from consumer_idem.transports.settle import DEAD_LETTER_BODY_DROPPED, RunnerStats

log = logging.getLogger("consumer_idem.transports.rabbit")

DEFAULT_RECONCILE_QUEUE = "consumer_idem.reconcile"
#: on a copy handed back after a long wait: the deliveries its original had already spent
SPENT_DELIVERIES = "x-consumer-idem-deliveries"
QUORUM = {"x-queue-type": "quorum"}
#: how long a delivery that failed unexpectedly waits before it is handed back
HANDBACK_BACKOFF = Backoff(0.5, 10.0)


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


def permanent(exc: BaseException) -> bool:
    """A publish error that recurs for the same message and queue. A refused publish (full
    queue with ``reject-publish``: a nack) and an unroutable one (no such queue yet) are
    transient: holding the delivery until it goes through is right, and a copy without its
    body would fare no better."""
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        return "size" in str(exc)  # "message size N is larger than configured max size M"
    return isinstance(exc, TypeError | ValueError)  # a header the client cannot encode


def dead_letter_headers(
    message: AbstractIncomingMessage, verdict: Verdict, queue: str, body_dropped: bool = False
) -> dict[str, Any]:
    """The message's own headers, the queue it first came from, why it is dead-lettered
    (reason, error text) and, for a copy without its body, the size of the dropped body."""
    headers: dict[str, Any] = dict(message.headers or {})
    headers.setdefault(ORIGINAL_QUEUE, queue)
    headers[DEAD_LETTER_REASON] = verdict.reason or "unknown"
    headers[DEAD_LETTER_SCOPE] = verdict.scope
    for name in (DEAD_LETTER_KEY, DEAD_LETTER_ERROR, DEAD_LETTER_BODY_DROPPED):
        headers.pop(name, None)
    if verdict.key is not None:
        headers[DEAD_LETTER_KEY] = verdict.key
    error = settle.error_header(verdict)
    if error is not None:
        headers[DEAD_LETTER_ERROR] = error
    if body_dropped:
        headers[DEAD_LETTER_BODY_DROPPED] = len(message.body)
    return headers


def handed_back_copy(message: AbstractIncomingMessage, spent: int | None) -> aio_pika.Message:
    """A copy of ``message`` to put back at the tail of its queue: same body, key, properties,
    with the deliveries it had spent (the broker's count starts again on a new message)."""
    headers: dict[str, Any] = {
        k: v for k, v in (message.headers or {}).items() if not k.startswith("x-delivery")
    }
    headers[SPENT_DELIVERIES] = str(spent or 0)
    return aio_pika.Message(
        message.body,
        headers=headers,
        message_id=message.message_id,
        correlation_id=message.correlation_id,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        type=message.type,
        app_id=message.app_id,
        reply_to=message.reply_to,
        priority=message.priority,
        timestamp=message.timestamp,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


def redispatch_headers(notice: Notice) -> dict[str, Any]:
    """The original headers of a notice's message, text ones as text (AMQP keeps types); not
    the deliveries a handed-back copy had spent (a re-dispatch is a new run)."""
    headers: dict[str, Any] = {}
    for name, value in notice.headers.items():
        if name == SPENT_DELIVERIES:
            continue
        try:
            headers[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            headers[name] = bytearray(value)
    return headers


def amqp_properties(message: AbstractIncomingMessage) -> dict[str, Any]:
    """The properties of a delivery that a notice carries (see ``notice.AMQP_PROPERTIES``)."""
    return {name: getattr(message, name, None) for name in AMQP_PROPERTIES}


def redispatch_properties(notice: Notice) -> dict[str, Any]:
    """A notice's AMQP properties as ``aio_pika.Message`` arguments (a timestamp as a UTC
    datetime)."""
    properties = dict(notice.properties)
    stamp = properties.pop("timestamp", None)
    if stamp is not None:
        properties["timestamp"] = datetime.fromtimestamp(stamp, UTC)
    return properties


def redispatch_message(notice: Notice) -> aio_pika.Message:
    """The original message of a notice as it was published: body, headers and properties
    (``message_id``, ``correlation_id``, ``content_type``, ``type``...), persistent, so every
    key strategy finds the original's key in the copy."""
    assert notice.body is not None
    return aio_pika.Message(
        notice.body,
        headers=redispatch_headers(notice),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        **redispatch_properties(notice),
    )


class RabbitRunner:
    """Consume ``queue`` through ``consumer``. ``await runner.run(stop_event)``."""

    def __init__(
        self,
        consumer: Processor,
        *,
        queue: str,
        url: str | None = None,
        prefetch: int = 32,
        dead_letter_queue: str | None = None,
        reconcile_queue: str = DEFAULT_RECONCILE_QUEUE,
        declare: bool = True,
        queue_arguments: dict[str, Any] | None = None,
        max_deliveries: int | None = 20,
        drain_timeout: float = 30.0,
        max_hold: float | None = 600.0,
    ) -> None:
        self.consumer = consumer
        self.queue_name = queue
        self.url = url or load_settings().amqp_url
        self.prefetch = prefetch
        self.dead_letter_queue = dead_letter_queue or f"{queue}.dlq"
        self.reconcile_queue = reconcile_queue
        self.declare = declare
        self.queue_arguments = QUORUM if queue_arguments is None else queue_arguments
        self.max_deliveries = max_deliveries
        self.drain_timeout = drain_timeout
        #: how long a waiting delivery stays in hand before it is handed back as a copy (keep it
        #: under RabbitMQ's ``consumer_timeout``, 30 minutes by default)
        self.max_hold = max_hold
        self.stats = RunnerStats()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._tag: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        await settle.check_store(self.consumer.store)
        await self.open_publisher()
        assert self._queue is not None
        self._tag = await self._queue.consume(self._on_message, no_ack=False)

    async def close_publisher(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def open_publisher(self) -> None:
        """Connect and declare, without consuming (notices, re-dispatch, a one-shot sweep)."""
        self._connection = await aio_pika.connect_robust(self.url)
        # confirms: a publish returns once the broker has it; on_return_raises: an unroutable
        # (mandatory) publish raises instead of returning as if it had been delivered
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        assert isinstance(channel, AbstractRobustChannel)
        self._channel = channel
        await channel.set_qos(prefetch_count=self.prefetch)
        # The consumed queue must come from declare_queue: only queues declared on a robust
        # channel are restored, with their consumers, after a reconnect.
        if self.declare:
            for name in (self.dead_letter_queue, self.reconcile_queue):
                await channel.declare_queue(name, durable=True, arguments=self.queue_arguments)
            self._queue = await channel.declare_queue(
                self.queue_name, durable=True, arguments=self.queue_arguments
            )
        else:
            self._queue = await channel.declare_queue(self.queue_name, passive=True)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set (or forever), then shut down gracefully: stop taking
        messages, finish those in hand (their acks), close."""
        if self._connection is None:
            await self.start()
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping.set()
        if self._queue is not None and self._tag is not None:
            with contextlib.suppress(Exception):
                await self._queue.cancel(self._tag)
            self._tag = None
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=self.drain_timeout)
            for task in late:  # unacked: the broker redelivers them after we close
                task.cancel()
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            verdict = await self._decide(message)
            await settle.settle(self, message, verdict)
        except asyncio.CancelledError:
            raise  # stop() gave up on it: unacked, the broker delivers it again after we close
        except Exception as exc:
            self.stats.failures += 1
            # a lost channel or connection is routine (broker restart): no traceback for it
            lost = isinstance(
                exc,
                aiormq.exceptions.AMQPError
                | aiormq.exceptions.ChannelInvalidStateError
                | ConnectionError,
            )
            log.log(
                logging.WARNING if lost else logging.ERROR,
                "delivery %s failed (%r); handing it back",
                message.delivery_tag,
                exc,
                exc_info=None if lost else exc,
            )
            await self._hand_back(message)

    async def _decide(self, message: AbstractIncomingMessage) -> Verdict:
        spent = spent_deliveries(to_message(message))
        if self.max_deliveries is not None and spent is not None and spent >= self.max_deliveries:
            return Verdict(Action.DEAD_LETTER, self.consumer.scope, reason="max_deliveries")
        # a fresh view per attempt: a handler that changed the parsed body in place must not
        # hand its changes to the next attempt
        return await settle.process_holding(
            lambda: self.consumer.process(to_message(message)),
            stats=self.stats,
            stopping=self._stopping.is_set,
            max_hold=self.max_hold,
        )

    async def _hand_back(self, message: AbstractIncomingMessage) -> None:
        count = to_message(message).delivery_count or 0
        await settle.pause(HANDBACK_BACKOFF.delay(count + 1), self._stopping.is_set)
        try:
            await message.nack(requeue=True)
        except Exception as exc:  # channel gone: the broker redelivers it anyway
            log.warning("could not hand back delivery %s: %r", message.delivery_tag, exc)

    # --- the settle-path transport (consumer_idem.transports.settle.Transport) --------------------

    @property
    def store(self) -> PostgresStore:
        return self.consumer.store

    def stopping(self) -> bool:
        return self._stopping.is_set()

    def permanent(self, exc: BaseException) -> bool:
        return permanent(exc)

    async def ack(self, message: AbstractIncomingMessage) -> None:
        await message.ack()

    async def retry_later(self, message: AbstractIncomingMessage, verdict: Verdict) -> None:
        if settle.is_wait(verdict) and not self.stopping():
            # held for max_hold already: hand it back without spending the delivery budget
            copy = handed_back_copy(message, spent_deliveries(to_message(message)))
            if await settle.publish_until_sent(
                lambda: self._publish(self.queue_name, copy),
                destination=self.queue_name,
                stopping=self.stopping,
                permanent=self.permanent,
            ):
                await message.ack()
                return
        await settle.pause(verdict.retry_after, self.stopping)
        await message.nack(requeue=True)

    async def give_back(self, message: AbstractIncomingMessage) -> None:
        """Stopping: left unacked; closing the channel returns it to the queue."""

    def dead_letter_destination(self, message: AbstractIncomingMessage) -> str:
        return self.dead_letter_queue

    def body_size(self, message: AbstractIncomingMessage) -> int:
        return len(message.body)

    async def send_dead_letter(
        self, message: AbstractIncomingMessage, verdict: Verdict, body_dropped: bool
    ) -> None:
        copy = aio_pika.Message(
            b"" if body_dropped else message.body,
            headers=dead_letter_headers(message, verdict, self.queue_name, body_dropped),
            message_id=message.message_id,
            content_type=message.content_type,
            correlation_id=message.correlation_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._publish(self.dead_letter_queue, copy)

    def notice_body(
        self, message: AbstractIncomingMessage, verdict: Verdict, with_original: bool
    ) -> bytes:
        if not with_original:
            return reconcile_notice(verdict)
        return reconcile_notice(
            verdict, to_message(message), self.queue_name, amqp_properties(message)
        )

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        notice = aio_pika.Message(
            body,
            content_type="application/json",
            headers={SCOPE_HEADER: scope, KEY_HEADER: key},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._publish(self.reconcile_queue, notice)

    async def send_redispatch(self, notice: Notice) -> None:
        assert notice.source is not None
        await self._publish(notice.source, redispatch_message(notice))

    async def _publish(self, routing_key: str, message: aio_pika.Message) -> None:
        if self._channel is None:
            raise aiormq.exceptions.ChannelInvalidStateError("not connected")
        # returns once the broker confirmed it (publisher confirms); raises on a nack or,
        # mandatory, when no queue took it
        await self._channel.default_exchange.publish(
            message, routing_key=routing_key, mandatory=True
        )

    # --- publishing for the reconciler and the sweeper (transports.settle.Publisher) ---

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        """Publish a reconciliation notice (confirmed) and record that it was published. Used
        by the sweeper for notices that were never sent; raises
        :class:`~consumer_idem.transports.settle.PublishRefused` when the broker refuses it for
        good."""
        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its queue, to run once."""
        return await settle.redispatch(self, notice)
