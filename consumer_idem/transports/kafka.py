"""Kafka transport (aiokafka): runs an :class:`IdempotentConsumer` over topics.

* Manual commits only (``enable_auto_commit=False``), of ``offset + 1`` of the contiguous prefix
  of each partition whose Postgres work has committed. Nothing is committed ahead of its effect.
* Order is kept within a partition (one worker per partition); partitions run concurrently, at
  most ``max_partitions_in_flight`` at a time. A message to retry (in progress elsewhere,
  retryable failure, store down) holds back only its own partition.
* A rebalance stops work on revoked partitions after the message in hand, commits what is done
  and hands them over; a new owner that meets a message still in flight elsewhere meets its lease.
* Poison records go to a dead-letter topic (default ``<topic>.dlq``) with their original
  coordinates and the reason in headers, and never block their partition.
* ``unknown`` outcomes publish a notice to the reconciliation topic before the offset moves.
  Both publishes use ``acks="all"`` and an idempotent producer, and go through the one settle
  path (``consumer_idem.transports.settle``): a publish the broker has not acknowledged holds
  the offset back; one it refuses for good (``MessageSizeTooLargeError``...) goes without the body.
* A worker that fails unexpectedly is logged with its traceback, counted in
  ``stats.failures``, and restarted after a backoff from the partition's first unsettled
  record (nothing after it was committed), so one bad partition neither stops the others nor
  skips a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
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
from consumer_idem.key_strategies import ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_TOPIC
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.settings import load_settings
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle
from consumer_idem.transports.settle import DEAD_LETTER_BODY_DROPPED, RunnerStats, Settled

log = logging.getLogger("consumer_idem.transports.kafka")

DEFAULT_RECONCILE_TOPIC = "consumer_idem.reconcile"

#: publish errors that recur for the same record and topic: retrying them would block the
#: partition for ever (anything else from the broker is treated as transient)
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    UnsupportedForMessageFormatError,
    PolicyViolationError,
    # the client's own checks of what it is given (header types...): the same next time
    AssertionError,
    TypeError,
    ValueError,
)
#: how long a partition whose worker failed waits before it is restarted
RESTART_BACKOFF = Backoff(1.0, 60.0)


def to_message(record: ConsumerRecord[bytes, bytes]) -> ConsumerMessage:
    headers = {name: (value or b"") for name, value in (record.headers or ())}
    return ConsumerMessage(
        body=record.value or b"",
        headers=headers,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        record_key=record.key,
        raw=record,
    )


def dead_letter_headers(
    record: ConsumerRecord[bytes, bytes], verdict: Verdict, body_dropped: bool = False
) -> list[tuple[str, bytes]]:
    """The record's own headers, its original coordinates (kept from the first dead-lettering
    when the record is already a copy), why it is dead-lettered (reason, error text) and, for a
    copy without its body, the size of the body that was dropped."""
    ours = {
        DEAD_LETTER_REASON,
        DEAD_LETTER_SCOPE,
        DEAD_LETTER_KEY,
        DEAD_LETTER_ERROR,
        DEAD_LETTER_BODY_DROPPED,
    }
    headers = [(k, v or b"") for k, v in (record.headers or ()) if k not in ours]
    if not any(k == ORIGINAL_TOPIC for k, _ in headers):
        headers += [
            (ORIGINAL_TOPIC, record.topic.encode()),
            (ORIGINAL_PARTITION, str(record.partition).encode()),
            (ORIGINAL_OFFSET, str(record.offset).encode()),
        ]
    headers += [
        (DEAD_LETTER_REASON, (verdict.reason or "unknown").encode()),
        (DEAD_LETTER_SCOPE, verdict.scope.encode()),
    ]
    if verdict.key is not None:
        headers.append((DEAD_LETTER_KEY, verdict.key.encode()))
    error = settle.error_header(verdict)
    if error is not None:
        headers.append((DEAD_LETTER_ERROR, error.encode("utf-8", "backslashreplace")))
    if body_dropped:
        headers.append((DEAD_LETTER_BODY_DROPPED, str(len(record.value or b"")).encode()))
    return headers


def redispatch_headers(notice: Notice) -> list[tuple[str, bytes]]:
    """The headers of a re-dispatched original: its own, including the ``x-original-*``
    coordinates the notice added (so ``kafka_coordinates()`` gives the copy the original's
    key)."""
    return list(notice.headers.items())


@dataclass
class _Partition:
    tp: TopicPartition
    pending: deque[ConsumerRecord[bytes, bytes]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
    revoked: bool = False
    paused: bool = False
    done: int | None = None  #: next offset to commit: last settled offset + 1
    committed: int | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0  #: consecutive worker failures (restart backoff)


@dataclass(frozen=True, slots=True)
class _Delivery:
    part: _Partition
    record: ConsumerRecord[bytes, bytes]


class KafkaRunner:
    """Consume ``topics`` in consumer group ``group_id`` through ``consumer``.

    Use ``await runner.run(stop_event)`` or ``start()`` / ``stop()``. ``stop()`` is graceful:
    it finishes the message in hand on every partition, commits, and leaves the group.
    """

    def __init__(
        self,
        consumer: Processor,
        *,
        topics: Sequence[str],
        group_id: str,
        bootstrap_servers: str | None = None,
        dead_letter_topic: str | Callable[[str], str] | None = None,
        reconcile_topic: str = DEFAULT_RECONCILE_TOPIC,
        max_records: int = 500,
        chunk: int | None = None,
        max_partitions_in_flight: int = 8,
        group_instance_id: str | None = None,
        revoke_timeout: float = 30.0,
        consumer_options: dict[str, Any] | None = None,
        producer_options: dict[str, Any] | None = None,
    ) -> None:
        self.consumer = consumer
        self.topics = list(topics)
        self.group_id = group_id
        self.bootstrap = bootstrap_servers or load_settings().kafka_bootstrap
        self._dlq = dead_letter_topic
        self.reconcile_topic = reconcile_topic
        self.max_records = max_records
        # How many records a worker settles before committing: a batch consumer takes the whole
        # fetch in one transaction; one-by-one consumers commit more often.
        self.chunk = chunk or (max_records if consumer.batch else 50)
        self.revoke_timeout = revoke_timeout
        self.stats = RunnerStats()
        self._slots = asyncio.Semaphore(max_partitions_in_flight)
        self._parts: dict[TopicPartition, _Partition] = {}
        self._commit_lock = asyncio.Lock()
        self._stopping = False
        self._started = False
        options: dict[str, Any] = {"auto_offset_reset": "earliest"}
        options.update(consumer_options or {})
        options["enable_auto_commit"] = False  # the whole point: commits follow Postgres commits
        self._kafka = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=group_id,
            group_instance_id=group_instance_id,
            **options,
        )
        producer = {"acks": "all", "enable_idempotence": True}
        producer.update(producer_options or {})
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, **producer)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await settle.check_store(self.consumer.store)
        await self._producer.start()
        try:
            self._kafka.subscribe(self.topics, listener=_Listener(self))
            await self._kafka.start()
        except BaseException:
            await self._producer.stop()
            raise
        self._started = True

    async def open_publisher(self) -> None:
        """Only the publishing side (notices, re-dispatch), e.g. for a one-shot sweep."""
        await self._producer.start()

    async def close_publisher(self) -> None:
        await self._producer.stop()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set (or forever), then shut down gracefully."""
        stop = stop or asyncio.Event()
        if not self._started:
            await self.start()
        try:
            while not stop.is_set():
                fetch = asyncio.ensure_future(
                    self._kafka.getmany(timeout_ms=500, max_records=self.max_records)
                )
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({fetch, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not fetch.done():
                    fetch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fetch
                    break
                self._dispatch(fetch.result())
                for part in list(self._parts.values()):
                    self._reap(part)
        finally:
            await self.stop()

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._stopping = True
        parts = list(self._parts.values())
        for part in parts:
            part.wake.set()
        await self._drain(parts)
        for part in parts:
            self._reap(part)
            await self._commit(part)
        with contextlib.suppress(Exception):
            await self._kafka.stop()
        await self._producer.stop()

    # --- fetching and dispatch -----------------------------------------------------------------

    def _dispatch(self, data: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        for tp, records in data.items():
            part = self._parts.get(tp)
            if part is None:
                part = self._parts[tp] = _Partition(tp)
            if part.revoked or not records:
                continue
            part.pending.extend(records)
            if len(part.pending) >= 2 * self.max_records and not part.paused:
                self._kafka.pause(tp)  # backpressure: stop fetching what we cannot keep up with
                part.paused = True
            self._reap(part)  # a dead worker is looked at before anything replaces it
            if part.task is None:
                part.task = asyncio.create_task(self._work(part), name=f"consumer-idem {tp}")

    def _reap(self, part: _Partition) -> None:
        """Look at a finished worker. One that failed is logged with its traceback and
        restarted (after a backoff, in ``_work``) from the partition's first unsettled record:
        records are only removed from ``pending`` once settled, and nothing after the first
        unsettled one is ever committed, so no record is skipped or committed unrun."""
        task = part.task
        if task is None or not task.done():
            return
        part.task = None
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.stats.failures += 1
        part.failures += 1
        head = part.pending[0].offset if part.pending else None
        log.error(
            "worker of %s failed; restarting it at offset %s (nothing after it is committed)",
            part.tp,
            head,
            exc_info=exc,
        )
        if part.pending and not part.revoked and not self._stopping:
            part.task = asyncio.create_task(self._work(part), name=f"consumer-idem {part.tp}")

    async def _work(self, part: _Partition) -> None:
        if part.failures:  # restarted after a failure: back off first (without holding a slot)
            await settle.pause(
                RESTART_BACKOFF.delay(part.failures), lambda: part.revoked or self._stopping
            )
        async with self._slots:
            while part.pending and not part.revoked and not self._stopping:
                chunk = [part.pending[i] for i in range(min(self.chunk, len(part.pending)))]
                verdicts = await self.consumer.process_batch([to_message(r) for r in chunk])
                retry: _Delivery | None = None
                wait: Verdict | None = None
                unsettled = False
                for record, verdict in zip(chunk, verdicts, strict=False):
                    if verdict.action is Action.RETRY:  # it and all after it wait (order)
                        retry, wait = _Delivery(part, record), verdict
                        break
                    outcome = await settle.settle(self, _Delivery(part, record), verdict)
                    if outcome is Settled.RETRY:  # not acked (its original could not be kept):
                        break  # processed again from this record, after the wait it took
                    if outcome is not Settled.ACKED:
                        unsettled = True  # stopping before its publish was confirmed
                        break
                await self._commit(part)
                if part.paused and len(part.pending) < self.max_records and not part.revoked:
                    with contextlib.suppress(Exception):
                        self._kafka.resume(part.tp)
                    part.paused = False
                if unsettled:
                    return
                if retry is not None and wait is not None:
                    await settle.settle(self, retry, wait)

    # --- the settle-path transport (consumer_idem.transports.settle.Transport) --------------------

    @property
    def store(self) -> PostgresStore:
        return self.consumer.store

    def stopping(self) -> bool:
        return self._stopping

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PERMANENT_ERRORS)

    async def ack(self, delivery: _Delivery) -> None:
        """The offset may be committed now; the worker commits the contiguous prefix."""
        part, record = delivery.part, delivery.record
        assert part.pending and part.pending[0] is record, "settled out of order"
        part.pending.popleft()
        part.done = record.offset + 1
        part.failures = 0

    async def retry_later(self, delivery: _Delivery, verdict: Verdict) -> None:
        """Not committed: the partition waits (its later records too, to keep the order) and
        the worker processes the record again."""
        part = delivery.part
        log.info(
            "retrying %s@%s in %.2fs (%s)",
            part.tp,
            delivery.record.offset,
            verdict.retry_after,
            verdict.reason,
        )
        part.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(part.wake.wait(), timeout=verdict.retry_after)

    async def give_back(self, delivery: _Delivery) -> None:
        """Nothing to do: the offset did not move; the record is read again after a restart."""

    def dead_letter_destination(self, delivery: _Delivery) -> str:
        return self._dead_letter_topic(delivery.record.topic)

    def body_size(self, delivery: _Delivery) -> int:
        return len(delivery.record.value or b"")

    async def send_dead_letter(
        self, delivery: _Delivery, verdict: Verdict, body_dropped: bool
    ) -> None:
        record = delivery.record
        await self._send(
            self._dead_letter_topic(record.topic),
            b"" if body_dropped else record.value,  # (aiokafka needs a key or a value)
            record.key,
            dead_letter_headers(record, verdict, body_dropped),
        )

    def notice_body(self, delivery: _Delivery, verdict: Verdict, with_original: bool) -> bytes:
        if not with_original:
            return reconcile_notice(verdict)
        record = delivery.record
        # the record key and (as x-original-* headers) the coordinates travel with it
        return reconcile_notice(verdict, to_message(record), source=record.topic)

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self._send(
            self.reconcile_topic,
            body,
            f"{scope}/{key}".encode(),
            [(SCOPE_HEADER, scope.encode()), (KEY_HEADER, key.encode())],
        )

    async def send_redispatch(self, notice: Notice) -> None:
        """The original as it was: its record key (so the same partitioner places it as the
        original), body and headers (with its original coordinates)."""
        assert notice.source is not None
        await self._send(notice.source, notice.body, notice.record_key, redispatch_headers(notice))

    async def _send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        # send_and_wait: returns once the broker acknowledged it (acks=all), raises otherwise
        await self._producer.send_and_wait(topic, value=value, key=key, headers=headers)

    # --- publishing for the reconciler and the sweeper (transports.settle.Publisher) ---

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        """Publish a reconciliation notice (``acks=all``) and record that it was published.
        Used by the sweeper for notices that were never sent; raises
        :class:`~consumer_idem.transports.settle.PublishRefused` when the broker refuses it for
        good."""
        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its topic, to run once."""
        return await settle.redispatch(self, notice)

    def _dead_letter_topic(self, topic: str) -> str:
        if self._dlq is None:
            return f"{topic}.dlq"
        return self._dlq(topic) if callable(self._dlq) else self._dlq

    async def _commit(self, part: _Partition) -> None:
        if part.done is None or part.done == part.committed:
            return
        async with self._commit_lock:
            offset = part.done
            try:
                await self._kafka.commit({part.tp: offset})
            except (KafkaError, AssertionError) as exc:
                # Rebalancing, or no longer ours: the next owner re-reads from the last commit
                # and meets completed records (replays), so nothing is lost or doubled.
                log.warning("commit of %s@%d failed: %r", part.tp, offset, exc)
                return
            part.committed = offset
            self.stats.commits += 1

    async def _drain(self, parts: list[_Partition]) -> None:
        tasks = [p.task for p in parts if p.task is not None and not p.task.done()]
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=self.revoke_timeout)
        for task in late:  # a handler that will not finish: its transaction rolls back
            task.cancel()
        if late:
            await asyncio.wait(late)

    # --- rebalance -----------------------------------------------------------------------------

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        parts = [self._parts[tp] for tp in revoked if tp in self._parts]
        for part in parts:
            part.revoked = True
            part.wake.set()
        await self._drain(parts)
        for part in parts:
            self._reap(part)
            await self._commit(part)
            del self._parts[part.tp]
        log.info("partitions revoked: %s", sorted(str(tp) for tp in revoked))


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runner: KafkaRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.runner._revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("partitions assigned: %s", sorted(str(tp) for tp in assigned))
