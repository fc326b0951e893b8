"""Kafka transport (aiokafka): runs an [`IdempotentConsumer`][consumer_idem.IdempotentConsumer] over
topics.

* Manual commits only (``enable_auto_commit=False``), of ``offset + 1`` of the contiguous prefix
  of each partition whose Postgres work has committed. Nothing is committed ahead of its effect.
  Commits run in the background after each chunk; stopping and revocations wait for them.
* Order is kept within a partition (one worker per partition); partitions run concurrently, at
  most ``max_partitions_in_flight`` chunks at a time. A message to retry (in progress
  elsewhere, retryable failure, store down) holds back only its own partition, and no slot.
* With ``offsets_in_postgres=True`` the consumed offsets live in Postgres
  (``consumer_idem.transports.kafka_offsets``), written with the effects and read on
  assignment; Kafka's committed offsets are then advisory.
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

from consumer_idem.extras import missing

try:
    import aiokafka  # noqa: F401 - the kafka extra
except ImportError as exc:
    raise missing("kafka", exc, __name__) from exc

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

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
from consumer_idem.errors import ConsumerIdemError
from consumer_idem.key_strategies import ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_TOPIC
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.outbox import OutboxService
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle, start_failures
from consumer_idem.transports.kafka_offset_check import start_positions
from consumer_idem.transports.kafka_offsets import OffsetHook, PostgresOffsets
from consumer_idem.transports.kafka_outbox import PERMANENT_ERRORS as PERMANENT_ERRORS
from consumer_idem.transports.kafka_outbox import KafkaOutboxSender as KafkaOutboxSender
from consumer_idem.transports.kafka_partition import RESTART_BACKOFF as RESTART_BACKOFF
from consumer_idem.transports.kafka_partition import Delivery, Partition
from consumer_idem.transports.settle import DEAD_LETTER_BODY_DROPPED, RunnerStats

log = logging.getLogger("consumer_idem.transports.kafka")

DEFAULT_RECONCILE_TOPIC = "consumer_idem.reconcile"


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


class KafkaRunner:
    """Consume ``topics`` in consumer group ``group_id`` through ``consumer``.

    Use ``await runner.run(stop_event)`` or ``start()`` / ``stop()``. ``stop()`` is graceful:
    it finishes the message in hand on every partition, commits, and leaves the group.

    The messages the consumer's handlers publish through the outbox (``outbox_for(conn)``)
    are sent with the runner's producer right after each COMMIT; every ``outbox_relay``
    seconds (None: never) a relay pass sends those of the consumer's scope that a crash or
    an outage left behind (``runner.outbox``: the
    [`OutboxService`][consumer_idem.transports.kafka.OutboxService]).

    ``offsets_in_postgres=True`` (an ``@idempotent_consumer`` only) keeps each partition's
    next offset in Postgres, in the same transaction as the effects it covers, and starts each
    assigned partition there (``runner.offsets``:
    [`PostgresOffsets`][consumer_idem.transports.kafka_offsets.PostgresOffsets]). The schema needs
    migration 0007.
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
        outbox_relay: float | None = 5.0,
        offsets_in_postgres: bool = False,
        consumer_options: dict[str, Any] | None = None,
        producer_options: dict[str, Any] | None = None,
    ) -> None:
        self.consumer = consumer
        self.topics = list(topics)
        self.group_id = group_id
        # the same variable the CLI and the examples read; aiokafka's own default otherwise
        self.bootstrap = bootstrap_servers or os.environ.get(
            "CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092"
        )
        self._dlq = dead_letter_topic
        self.reconcile_topic = reconcile_topic
        self.max_records = max_records
        # How many records a worker settles before committing: a batch consumer takes the whole
        # fetch in one transaction; one-by-one consumers commit more often.
        self.chunk = chunk or (max_records if consumer.batch else 50)
        self.revoke_timeout = revoke_timeout
        self.stats = RunnerStats()
        self.slots = asyncio.Semaphore(max_partitions_in_flight)
        # an IdempotentConsumer's keys and fingerprints can be computed ahead (not the
        # reconciler's: it has no such step)
        self.prepare: Callable[[ConsumerMessage], Any] | None = (
            consumer.prepare if isinstance(consumer, IdempotentConsumer) else None
        )
        # offsets in Postgres: written with the effects (the hook) and read on assignment
        self.offsets: PostgresOffsets | None = None
        self.stored: dict[tuple[str, int], int] = {}  #: next offsets Postgres holds
        self.hook: OffsetHook | None = None
        if offsets_in_postgres:
            if not isinstance(consumer, IdempotentConsumer):
                raise TypeError("offsets_in_postgres needs an @idempotent_consumer")
            self.offsets = PostgresOffsets(consumer.store, group_id)
            self.hook = OffsetHook(self.offsets, self.stored)
        self._probe_options = {"bootstrap_servers": self.bootstrap, **(consumer_options or {})}
        self._parts: dict[TopicPartition, Partition] = {}
        self._generation = 0  #: rebalances seen (revocations and assignments)
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
        self.outbox = OutboxService(
            consumer.store,
            KafkaOutboxSender(self._producer, cluster=self.bootstrap),
            scopes=[consumer.scope],
            relay_interval=outbox_relay,
        )

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await settle.check_store(self.consumer.store)
        try:
            await self._producer.start()
            await self.outbox.start()
            self._kafka.subscribe(self.topics, listener=_Listener(self))
            await self._kafka.start()
        except BaseException:  # close all it opened: the consumer too, even half-started
            await start_failures.close_all(self._kafka.stop, self.outbox.stop, self._producer.stop)
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
                fetch = asyncio.ensure_future(self._fetch())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({fetch, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not fetch.done():
                    fetch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fetch
                    break
                generation, records = fetch.result()
                if generation == self._generation:
                    self._dispatch(records)
                # else handed over before a rebalance that ran before they could be
                # dispatched: dropped, and read again from the positions the rebalance set
                # (every partition's: aiokafka's rebalances are eager), so a record is not run
                # by a consumer that no longer owns it, nor twice by one that owns it again
                for part in list(self._parts.values()):
                    part.reap()
        finally:
            await self.stop()

    async def _fetch(
        self,
    ) -> tuple[int, dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]]:
        records = await self._kafka.getmany(timeout_ms=500, max_records=self.max_records)
        return self._generation, records  # the rebalances seen when aiokafka handed them over

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._stopping = True
        parts = list(self._parts.values())
        for part in parts:
            part.wake.set()
        await self._drain(parts)
        await self._final_commits(parts)
        with contextlib.suppress(Exception):
            await self._kafka.stop()
        await self.outbox.stop()  # sends what the units committed meanwhile
        await self._producer.stop()

    # --- fetching and dispatch -----------------------------------------------------------------

    def _dispatch(self, data: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        for tp, records in data.items():
            part = self._parts.get(tp)
            if part is None:
                part = self._parts[tp] = Partition(self, tp)
            if not part.revoked and records:
                part.add(records)

    #: how a partition reads a record
    to_message = staticmethod(to_message)

    def pause(self, tp: TopicPartition) -> None:
        self._kafka.pause(tp)

    def resume(self, tp: TopicPartition) -> None:
        with contextlib.suppress(Exception):  # revoked meanwhile: nothing to resume
            self._kafka.resume(tp)

    async def commit_offset(self, tp: TopicPartition, offset: int) -> None:
        await self._kafka.commit({tp: offset})

    # --- the settle-path transport (consumer_idem.transports.settle.Transport) --------------------

    @property
    def store(self) -> PostgresStore:
        return self.consumer.store

    def stopping(self) -> bool:
        return self._stopping

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PERMANENT_ERRORS)

    async def ack(self, delivery: Delivery) -> None:
        """The offset may be committed now; the worker commits the contiguous prefix."""
        delivery.part.acked(delivery.record)

    async def retry_later(self, delivery: Delivery, verdict: Verdict) -> None:
        """Not committed: the partition waits (its later records too, to keep the order) and
        the worker processes the record again."""
        log.info(
            "scope=%s key=%s: retrying %s@%s in %.2fs (%s)",
            verdict.scope,
            verdict.key,
            delivery.part.tp,
            delivery.record.offset,
            verdict.retry_after,
            verdict.reason,
        )
        await delivery.part.wait(verdict.retry_after)

    async def give_back(self, delivery: Delivery) -> None:
        """Nothing to do: the offset did not move; the record is read again after a restart."""

    def dead_letter_destination(self, delivery: Delivery) -> str:
        return self._dead_letter_topic(delivery.record.topic)

    def body_size(self, delivery: Delivery) -> int:
        return len(delivery.record.value or b"")

    async def send_dead_letter(
        self, delivery: Delivery, verdict: Verdict, body_dropped: bool
    ) -> None:
        record = delivery.record
        await self._send(
            self._dead_letter_topic(record.topic),
            b"" if body_dropped else record.value,  # (aiokafka needs a key or a value)
            record.key,
            dead_letter_headers(record, verdict, body_dropped),
        )

    def notice_body(self, delivery: Delivery, verdict: Verdict, with_original: bool) -> bytes:
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
        `PublishRefused` when the broker refuses it for
        good."""
        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its topic, to run once."""
        return await settle.redispatch(self, notice)

    def _dead_letter_topic(self, topic: str) -> str:
        if self._dlq is None:
            return f"{topic}.dlq"
        return self._dlq(topic) if callable(self._dlq) else self._dlq

    async def _final_commits(self, parts: list[Partition]) -> None:
        """Stopping, or the partitions are revoked: their last offsets committed, and every
        commit still running in the background finished, before they are let go."""
        for part in parts:
            part.reap()
            await part.commit()
        committers = [p.committer for p in parts if p.committer is not None]
        await asyncio.gather(*committers, return_exceptions=True)

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        """With offsets in Postgres: start each assigned partition at its stored offset, if it
        belongs to the partition's log (``kafka_offset_check``); one the group never stored, or
        that belongs to another log, starts where Kafka says: its committed offset, or the reset
        policy. While the store does not answer, it is asked again for ``revoke_timeout``;
        after that the partitions start at Kafka's committed offsets, which are never ahead of
        Postgres's, so the records between are met again and replayed by their keys."""
        self._generation += 1
        log.info("partitions assigned: %s", sorted(str(tp) for tp in assigned))
        if self.offsets is None or not assigned:
            return
        # Nothing is fetched until the positions are set: aiokafka starts fetching from the
        # committed offsets while this listener still waits for Postgres.
        self._kafka.pause(*assigned)
        try:
            await self._seek_to_stored(assigned)
        finally:
            with contextlib.suppress(Exception):  # revoked meanwhile: nothing to resume
                self._kafka.resume(*assigned)

    async def _seek_to_stored(self, assigned: set[TopicPartition]) -> None:
        assert self.offsets is not None
        by_key = {(tp.topic, tp.partition): tp for tp in assigned}
        deadline = asyncio.get_running_loop().time() + self.revoke_timeout
        attempt = 0
        while True:
            try:
                stored = await self.offsets.load(by_key)
                break
            except ConsumerIdemError as exc:
                attempt += 1
                if asyncio.get_running_loop().time() >= deadline or self._stopping:
                    log.error(
                        "stored offsets of %s unreadable (%s): starting at Kafka's committed "
                        "offsets; records after them are replayed by their keys",
                        sorted(str(tp) for tp in assigned),
                        exc,
                    )
                    return
                await asyncio.sleep(RESTART_BACKOFF.delay(attempt))
        assert isinstance(self.consumer, IdempotentConsumer)
        positions = await start_positions(
            self._kafka, self.offsets, stored, self._probe_options, self.consumer.scope
        )
        for key, offset in positions.items():
            self.stored[key] = stored[key][0]
            self._kafka.seek(by_key[key], offset)
        log.info("started at the offsets stored in Postgres: %s", sorted(positions.items()))

    async def _drain(self, parts: list[Partition]) -> None:
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
        self._generation += 1
        parts = [self._parts[tp] for tp in revoked if tp in self._parts]
        for part in parts:
            part.revoked = True
            part.wake.set()
        await self._drain(parts)
        await self._final_commits(parts)
        for part in parts:
            del self._parts[part.tp]
        for tp in revoked:  # read again if it comes back: someone else may move it on
            self.stored.pop((tp.topic, tp.partition), None)
        log.info("partitions revoked: %s", sorted(str(tp) for tp in revoked))


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runner: KafkaRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.runner._revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.runner._assigned(assigned)
