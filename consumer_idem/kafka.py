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
  Both publishes use ``acks="all"`` and an idempotent producer.
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
from aiokafka.errors import KafkaError

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
from consumer_idem.key_strategies import ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_TOPIC
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.settings import load_settings

log = logging.getLogger("consumer_idem.kafka")

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
    record: ConsumerRecord[bytes, bytes], verdict: Verdict
) -> list[tuple[str, bytes]]:
    """The record's own headers, its original coordinates (kept from the first dead-lettering
    when the record is already a copy) and why it is dead-lettered."""
    ours = {DEAD_LETTER_REASON, DEAD_LETTER_SCOPE, DEAD_LETTER_KEY}
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
    return headers


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
                self._raise_worker_failures()
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
            if part.task is None or part.task.done():
                part.task = asyncio.create_task(self._work(part), name=f"consumer-idem {tp}")

    def _raise_worker_failures(self) -> None:
        for part in self._parts.values():
            if part.task is not None and part.task.done() and not part.task.cancelled():
                exc = part.task.exception()
                if exc is not None:
                    raise exc

    async def _work(self, part: _Partition) -> None:
        async with self._slots:
            while part.pending and not part.revoked and not self._stopping:
                chunk = [part.pending[i] for i in range(min(self.chunk, len(part.pending)))]
                verdicts = await self.consumer.process_batch([to_message(r) for r in chunk])
                settled = 0
                retry: Verdict | None = None
                for record, verdict in zip(chunk, verdicts, strict=False):
                    if verdict.action is Action.RETRY:
                        retry = verdict
                        break
                    if not await self._settle(record, verdict):
                        break  # stopping while a publish could not be made: do not move on
                    settled += 1
                    part.done = record.offset + 1
                for _ in range(settled):
                    part.pending.popleft()
                await self._commit(part)
                if part.paused and len(part.pending) < self.max_records and not part.revoked:
                    with contextlib.suppress(Exception):
                        self._kafka.resume(part.tp)
                    part.paused = False
                if retry is not None:
                    self.stats.retries += 1
                    log.info(
                        "retrying %s@%s in %.2fs (%s)",
                        part.tp,
                        chunk[settled].offset,
                        retry.retry_after,
                        retry.reason,
                    )
                    part.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(part.wake.wait(), timeout=retry.retry_after)

    async def _settle(self, record: ConsumerRecord[bytes, bytes], verdict: Verdict) -> bool:
        """Carry out a final verdict: publish what must be published, durably, before the offset
        may move. Returns False only when stopping interrupted an unfinished publish."""
        if verdict.action is Action.DEAD_LETTER:
            topic = self._dead_letter_topic(record.topic)
            headers = dead_letter_headers(record, verdict)
            ok = await self._publish(topic, record.value, record.key, headers)
            if ok:
                self.stats.dead_lettered += 1
                log.warning(
                    "dead-lettered %s/%s@%s to %s: %s",
                    record.topic,
                    record.partition,
                    record.offset,
                    topic,
                    verdict.reason,
                )
        elif verdict.reconcile:
            assert verdict.key is not None
            body = reconcile_notice(verdict, to_message(record), source=record.topic)
            ok = await self.publish_notice(verdict.scope, verdict.key, body)
        else:
            ok = True
            if verdict.duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.executed += 1
        if ok:
            self.stats.processed += 1
        return ok

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        """Publish a reconciliation notice (``acks=all``) and record that it was published.
        Also used by the sweeper for notices that were never sent."""
        ok = await self._publish(
            self.reconcile_topic,
            body,
            f"{scope}/{key}".encode(),
            [(SCOPE_HEADER, scope.encode()), (KEY_HEADER, key.encode())],
        )
        if ok:
            await notice_published(self.stats, self.consumer.store, scope, key)
        return ok

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to its topic, to run once."""
        if notice.source is None or notice.body is None:
            return False
        return await self._publish(
            notice.source, notice.body, notice.key.encode(), list(notice.headers.items())
        )

    async def _publish(
        self, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> bool:
        return await publish_until_sent(
            lambda: self._producer.send_and_wait(topic, value=value, key=key, headers=headers),
            destination=topic,
            stopping=lambda: self._stopping,
            retry_on=KafkaError,
        )

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
