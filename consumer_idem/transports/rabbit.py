"""RabbitMQ transport (aio-pika): runs an [`IdempotentConsumer`][consumer_idem.IdempotentConsumer]
over a queue.

* Ack only after the Postgres commit; at most ``prefetch`` unacked messages are in hand.
* Dead-letter and reconciliation publishes wait for publisher confirms before the ack (one
  settle path, ``consumer_idem.transports.settle``); an unroutable publish is an error, not a
  success.
* Waiting is not failing. A delivery whose store is unavailable, or whose key another consumer
  holds, stays in hand and is processed again after a backoff, for up to ``max_hold`` seconds;
  then it is handed back as a confirmed copy at the tail of its queue (and the original acked),
  which carries its delivery count along. Neither spends the delivery budget.
* A handler failure worth retrying is held for ``retry_after`` seconds and then
  ``nack(requeue=True)``-ed: the prefetch slot, not the whole queue, waits. The delivery budget
  (``max_deliveries``) counts the attempts that ran the key's handler, in Postgres; the broker's
  ``x-delivery-count`` only says which deliveries to count, and they run alone
  (``delivery_budget``). At the budget the key's record is read: a completed key is acked,
  never dead-lettered. The consumed queue's ``x-delivery-limit`` is declared or checked so
  that the broker never decides first (``rabbit_limits``).
* Any unexpected exception while handling a delivery is logged with its traceback, counted in
  ``stats.failures``, and the delivery is ``nack(requeue=True)``-ed after a short backoff: no
  delivery is ever left unsettled in hand.
* ``connect_robust`` reconnects after a broker restart and restores the consumer; unacked
  messages of the lost channel are redelivered and meet their completed records (replays).
* Batch mode (a consumer decorated with ``batch=True``): deliveries from the prefetch window
  are grouped, up to ``batch_size`` of them or whatever arrived within ``batch_wait`` seconds,
  and each group is claimed, handled and completed in one transaction
  ([`IdempotentConsumer.process_batch`][consumer_idem.IdempotentConsumer.process_batch], which falls
  back to one transaction per message
  when a member fails). Acks follow the commit, as one ``basic.ack(multiple=True)`` per
  contiguous run of delivery tags ([`AckWindow`][consumer_idem.transports.rabbit.AckWindow]). A
  delivery the broker has delivered
  before (``x-delivery-count``, or ``redelivered``) runs on its own, never in a shared batch,
  counted as above: a poison's crashes do not spend its batch-mates' budgets.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import aio_pika  # the rabbit extra
except ImportError as exc:
    raise missing("rabbit", exc, __name__) from exc

import asyncio
import contextlib
import logging
import os
from datetime import UTC, datetime
from typing import Any

import aiormq
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from consumer_idem.consumer import (
    DEAD_LETTER_ERROR,
    DEAD_LETTER_KEY,
    DEAD_LETTER_REASON,
    DEAD_LETTER_SCOPE,
    IdempotentConsumer,
    Processor,
    Verdict,
    reconcile_notice,
)
from consumer_idem.notice import AMQP_PROPERTIES, KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.notice import ORIGINAL_QUEUE as ORIGINAL_QUEUE
from consumer_idem.outbox import OutboxService
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle, start_failures
from consumer_idem.transports.delivery_budget import DeliveryBudget
from consumer_idem.transports.rabbit_acks import AckWindow as AckWindow
from consumer_idem.transports.rabbit_collector import BatchCollector
from consumer_idem.transports.rabbit_limits import check_arguments, declare_consumed
from consumer_idem.transports.rabbit_message import SPENT_DELIVERIES as SPENT_DELIVERIES
from consumer_idem.transports.rabbit_message import redelivered_before as redelivered_before
from consumer_idem.transports.rabbit_message import spent_deliveries as spent_deliveries
from consumer_idem.transports.rabbit_message import to_message as to_message
from consumer_idem.transports.rabbit_outbox import QUORUM as QUORUM
from consumer_idem.transports.rabbit_outbox import RabbitOutboxSender as RabbitOutboxSender
from consumer_idem.transports.rabbit_outbox import outgoing_message as outgoing_message
from consumer_idem.transports.rabbit_outbox import permanent as permanent
from consumer_idem.transports.rabbit_window import HANDBACK_BACKOFF as HANDBACK_BACKOFF
from consumer_idem.transports.rabbit_window import ChannelWindow
from consumer_idem.transports.settle import DEAD_LETTER_BODY_DROPPED, RunnerStats

log = logging.getLogger("consumer_idem.transports.rabbit")

DEFAULT_RECONCILE_QUEUE = "consumer_idem.reconcile"


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
    """Consume ``queue`` through ``consumer``. ``await runner.run(stop_event)``.

    The messages the consumer's handlers publish through the outbox (``outbox_for(conn)``)
    are sent on the runner's connection right after each COMMIT (to queues it declares like
    its own); every ``outbox_relay`` seconds (None: never) a relay pass sends those of the
    consumer's scope that a crash or an outage left behind (``runner.outbox``).

    With a batch consumer (``@idempotent_consumer(..., batch=True)``) the runner works in batch
    mode: ``batch_size`` deliveries per transaction at most, a batch closes after ``batch_wait``
    seconds however full it is, and ``prefetch`` (default ``4 * batch_size``) must hold at
    least one whole batch. Otherwise one transaction per delivery, ``prefetch`` (default 32)
    of them at once.
    """

    def __init__(
        self,
        consumer: Processor,
        *,
        queue: str,
        url: str | None = None,
        prefetch: int | None = None,
        dead_letter_queue: str | None = None,
        reconcile_queue: str = DEFAULT_RECONCILE_QUEUE,
        declare: bool = True,
        queue_arguments: dict[str, Any] | None = None,
        max_deliveries: int | None = 20,
        drain_timeout: float = 30.0,
        max_hold: float | None = 600.0,
        batch_size: int = 100,
        batch_wait: float = 0.05,
        outbox_relay: float | None = 5.0,
    ) -> None:
        self.consumer = consumer
        #: batch mode: one transaction per group of deliveries (see the class docstring)
        self.batch = bool(getattr(consumer, "batch", False))
        if batch_size < 1 or batch_wait < 0:
            raise ValueError("batch_size must be at least 1 and batch_wait not negative")
        self.batch_size = batch_size
        self.batch_wait = batch_wait
        if prefetch is None:
            prefetch = 4 * batch_size if self.batch else 32
        if self.batch and prefetch < batch_size:
            raise ValueError(
                f"prefetch ({prefetch}) must be at least batch_size ({batch_size}): a batch "
                "holds its deliveries unacked until its transaction commits"
            )
        self.queue_name = queue
        # the same variable the CLI and the examples read; aio-pika's usual default otherwise
        self.url = url or os.environ.get(
            "CONSUMER_IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"
        )
        self.prefetch = prefetch
        self.dead_letter_queue = dead_letter_queue or f"{queue}.dlq"
        self.reconcile_queue = reconcile_queue
        self.declare = declare
        self.queue_arguments = QUORUM if queue_arguments is None else queue_arguments
        self.max_deliveries = max_deliveries
        check_arguments(self.queue_arguments, max_deliveries, queue)
        #: counted in Postgres for a consumer with keys; the broker's count otherwise
        self._budget = (
            DeliveryBudget(consumer, max_deliveries)
            if isinstance(consumer, IdempotentConsumer)
            else None
        )
        #: the deliveries in hand and their workers
        self.window = ChannelWindow(self, self._budget)
        self.drain_timeout = drain_timeout
        #: how long a waiting delivery stays in hand before it is handed back as a copy (keep it
        #: under RabbitMQ's ``consumer_timeout``, 30 minutes by default)
        self.max_hold = max_hold
        self.stats = RunnerStats()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._tag: str | None = None
        self._stopping = asyncio.Event()
        # batch mode: the collector of the next batch, the ack window of each channel (by id;
        # its numbering starts again after a reconnect) and the task that sends the acks
        self._collector = BatchCollector(
            batch_size, batch_wait, lambda batch: self.window.spawn(self.window.handle_batch(batch))
        )
        self._windows: dict[int, AckWindow] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._acks_due = asyncio.Event()
        self.outbox = OutboxService(
            consumer.store,
            RabbitOutboxSender(
                lambda: self._connection,
                declare=declare,
                queue_arguments=self.queue_arguments,
                broker=self.url,
            ),
            scopes=[consumer.scope],
            relay_interval=outbox_relay,
        )

    async def start(self) -> None:
        await settle.check_store(self.consumer.store)
        await self.open_publisher()
        assert self._queue is not None
        try:
            await self.outbox.start()
            self._tag = await self._queue.consume(self._on_message, no_ack=False)
        except BaseException:
            await start_failures.close_all(self.outbox.stop, self.close_publisher)
            raise

    async def close_publisher(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def open_publisher(self) -> None:
        """Connect and declare, without consuming (notices, re-dispatch, a one-shot sweep)."""
        self._connection = await aio_pika.connect_robust(self.url)
        try:
            await self._open_channel()
        except BaseException as exc:  # nothing stays open; a queue mismatch in one line
            await start_failures.close_all(self.close_publisher)
            mismatch = start_failures.queue_mismatch(exc, self.queue_arguments)
            if mismatch is not None:
                raise mismatch from None
            raise

    async def _open_channel(self) -> None:
        assert self._connection is not None
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
            self._queue = await declare_consumed(
                self._connection,
                channel,
                self.queue_name,
                self.queue_arguments,
                self.max_deliveries,
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
        self._collector.close()  # what was gathered is in hand: finish it like the rest
        await self.window.drain(self.drain_timeout)
        await self.outbox.stop()  # sends what the units committed meanwhile
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if not self.batch:
            self.window.spawn(self.window.handle(message))
        elif not self._stopping.is_set():
            self._collector.add(message)
        # else: arrived after the cancel: unacked, the broker has it back when we close

    def _ack_window(self, message: AbstractIncomingMessage) -> AckWindow:
        channel = message.channel  # raises once the channel is closed: nothing to ack there
        window = self._windows.get(id(channel))
        if window is None or window.channel is not channel:
            # a new channel (after a reconnect its numbering starts again); forget closed ones
            self._windows = {k: w for k, w in self._windows.items() if not w.channel.is_closed}
            window = self._windows[id(channel)] = AckWindow(channel, self.batch_wait)
        return window

    async def _flush_acks(self) -> None:
        while True:
            self._acks_due.clear()
            due: float | None = None
            for window in list(self._windows.values()):
                try:
                    left = await window.flush()
                except Exception as exc:  # its channel is gone: the broker redelivers them
                    log.warning("acks on a lost channel failed (%r)", exc)
                    window.abandon()
                    continue
                if left is not None:
                    due = left if due is None else min(due, left)
            if not any(w.pending for w in self._windows.values()):
                return
            with contextlib.suppress(TimeoutError):  # new acks, or the lingering ones are due
                await asyncio.wait_for(self._acks_due.wait(), due)

    async def send(self, message: AbstractIncomingMessage, *, ack: bool) -> None:
        """Ack, or hand back (``nack``, requeue), this one delivery now; in batch mode its ack
        window learns that the tag is settled."""
        window = self._ack_window(message) if self.batch else None
        if ack:
            await message.ack()
        else:
            await message.nack(requeue=True)
        if window is not None:
            window.settled(message.delivery_tag)

    # --- the settle-path transport (consumer_idem.transports.settle.Transport) --------------------

    @property
    def store(self) -> PostgresStore:
        return self.consumer.store

    def stopping(self) -> bool:
        return self._stopping.is_set()

    def permanent(self, exc: BaseException) -> bool:
        return permanent(exc)

    async def ack(self, message: AbstractIncomingMessage) -> None:
        if not self.batch:
            await message.ack()
            return
        # batch mode: the ack goes out with its neighbours' (see AckWindow), from one task
        self._ack_window(message).ready(message)
        self._acks_due.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = self.window.spawn(self._flush_acks())

    async def retry_later(self, message: AbstractIncomingMessage, verdict: Verdict) -> None:
        counted_ahead = redelivered_before(message)  # a suspect counted itself ahead
        if self._budget is not None and not settle.is_wait(verdict) and not counted_ahead:
            await self._budget.failed(verdict)
        if settle.is_wait(verdict) and not self.stopping():
            # held for max_hold already: hand it back without spending the delivery budget
            copy = handed_back_copy(message, spent_deliveries(to_message(message)))
            if await settle.publish_until_sent(
                lambda: self._publish(self.queue_name, copy),
                destination=self.queue_name,
                stopping=self.stopping,
                permanent=self.permanent,
            ):
                await self.send(message, ack=True)
                return
        await settle.pause(verdict.retry_after, self.stopping)
        await self.send(message, ack=False)

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
        `PublishRefused` when the broker refuses it for
        good."""
        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its queue, to run once."""
        return await settle.redispatch(self, notice)
