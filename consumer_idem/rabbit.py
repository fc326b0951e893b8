"""RabbitMQ transport (aio-pika): runs an :class:`IdempotentConsumer` over a queue.

* Ack only after the Postgres commit; at most ``prefetch`` unacked messages are in hand.
* A message to retry is held for ``retry_after`` seconds and then ``nack(requeue=True)``:
  the prefetch slot, not the whole queue, waits.
* Dead-letter and reconciliation publishes wait for publisher confirms before the ack.
* Quorum queues count redeliveries in ``x-delivery-count``; a message redelivered
  ``max_deliveries`` times (it keeps killing the consumer) is dead-lettered without running.
* ``connect_robust`` reconnects after a broker restart and restores the consumer; unacked
  messages of the lost channel are redelivered and meet their completed records (replays).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from consumer_idem.consumer import (
    DEAD_LETTER_KEY,
    DEAD_LETTER_REASON,
    DEAD_LETTER_SCOPE,
    Action,
    Processor,
    RunnerStats,
    Verdict,
    notice_published,
    publish_until_sent,
    reconcile_notice,
)
from consumer_idem.message import ConsumerMessage, header_bytes
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.settings import load_settings

log = logging.getLogger("consumer_idem.rabbit")

DEFAULT_RECONCILE_QUEUE = "consumer_idem.reconcile"
ORIGINAL_QUEUE = "x-original-queue"
QUORUM = {"x-queue-type": "quorum"}


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


def dead_letter_headers(
    message: AbstractIncomingMessage, verdict: Verdict, queue: str
) -> dict[str, Any]:
    """The message's own headers, the queue it first came from and why it is dead-lettered."""
    headers: dict[str, Any] = dict(message.headers or {})
    headers.setdefault(ORIGINAL_QUEUE, queue)
    headers[DEAD_LETTER_REASON] = verdict.reason or "unknown"
    headers[DEAD_LETTER_SCOPE] = verdict.scope
    if verdict.key is not None:
        headers[DEAD_LETTER_KEY] = verdict.key
    return headers


def redispatch_headers(notice: Notice) -> dict[str, Any]:
    """The original headers of a notice's message, text ones as text (AMQP keeps types)."""
    headers: dict[str, Any] = {k: bytearray(v) for k, v in notice.headers.items()}
    for name, value in notice.headers.items():
        with contextlib.suppress(UnicodeDecodeError):
            headers[name] = value.decode("utf-8")
    return headers


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
        self.stats = RunnerStats()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._tag: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def start(self) -> None:
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
        channel = await self._connection.channel(publisher_confirms=True)
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
        incoming = to_message(message)
        if (
            self.max_deliveries is not None
            and incoming.delivery_count is not None
            and incoming.delivery_count >= self.max_deliveries
        ):
            verdict = Verdict(Action.DEAD_LETTER, self.consumer.scope, reason="max_deliveries")
        else:
            verdict = await self.consumer.process(incoming)
        try:
            if verdict.action is Action.RETRY:
                self.stats.retries += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=verdict.retry_after)
                await message.nack(requeue=True)
                return
            if verdict.action is Action.DEAD_LETTER:
                if not await self._dead_letter(message, verdict):
                    return  # stopping before it could be published: left unacked, redelivered
                self.stats.dead_lettered += 1
            elif verdict.reconcile:
                if not await self._notify_reconcile(verdict, message):
                    return
            elif verdict.duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.executed += 1
            await message.ack()
            self.stats.processed += 1
        except Exception as exc:  # channel lost mid-ack: the redelivery replays the stored result
            log.warning("could not settle delivery %s: %r", message.delivery_tag, exc)

    async def _publish(self, routing_key: str, message: aio_pika.Message) -> bool:
        assert self._channel is not None
        exchange = self._channel.default_exchange
        # awaited publishes return once the broker confirmed them (publisher confirms are on)
        return await publish_until_sent(
            lambda: exchange.publish(message, routing_key=routing_key, mandatory=True),
            destination=routing_key,
            stopping=self._stopping.is_set,
        )

    async def _dead_letter(self, message: AbstractIncomingMessage, verdict: Verdict) -> bool:
        copy = aio_pika.Message(
            message.body,
            headers=dead_letter_headers(message, verdict, self.queue_name),
            message_id=message.message_id,
            content_type=message.content_type,
            correlation_id=message.correlation_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        ok = await self._publish(self.dead_letter_queue, copy)
        if ok:
            log.warning("dead-lettered to %s: %s", self.dead_letter_queue, verdict.reason)
        return ok

    async def _notify_reconcile(self, verdict: Verdict, message: AbstractIncomingMessage) -> bool:
        assert verdict.key is not None
        body = reconcile_notice(verdict, to_message(message), source=self.queue_name)
        return await self.publish_notice(verdict.scope, verdict.key, body)

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        """Publish a reconciliation notice (confirmed) and record that it was published.
        Also used by the sweeper for notices that were never sent."""
        notice = aio_pika.Message(
            body,
            content_type="application/json",
            headers={SCOPE_HEADER: scope, KEY_HEADER: key},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        if not await self._publish(self.reconcile_queue, notice):
            return False
        await notice_published(self.stats, self.consumer.store, scope, key)
        return True

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its queue, to run once."""
        if notice.source is None or notice.body is None:
            return False
        message = aio_pika.Message(
            notice.body,
            headers=redispatch_headers(notice),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        return await self._publish(notice.source, message)
