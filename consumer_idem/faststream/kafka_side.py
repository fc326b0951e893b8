"""The Kafka side of a FastStream subscriber: per-partition commits, seeks, publishes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from faststream import StreamMessage
from faststream.message import AckStatus

from consumer_idem.consumer import (
    Verdict,
)
from consumer_idem.errors import (
    IdempotencyConfigError,
)
from consumer_idem.faststream import _compat
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


class _Kafka:
    holds_waits = False  # a seek back costs nothing; holding would exceed max.poll.interval

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        self.idem = idem
        self.broker = broker
        # batch subscribers' background commits, per consumer (by id: Confluent's consumer
        # wrapper cannot be weakly referenced): the offsets still to commit and the task
        # committing them, both dropped when the task ends (so an id is never reused here)
        self._uncommitted: dict[int, dict[tuple[str, int], int]] = {}
        self._committers: dict[int, asyncio.Task[None]] = {}
        self._bind_client()
        if not self.durable_producer():
            log.warning(
                "KafkaBroker without acks='all': a dead letter or reconciliation notice may be "
                "lost with a broker failover after its delivery was committed. "
                "Create it with KafkaBroker(..., acks='all', enable_idempotence=True)."
            )

    def _bind_client(self) -> None:
        """The Kafka client's types this side uses (aiokafka's here)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

        self._consumer_type: type = AIOKafkaConsumer
        self._tp: Any = TopicPartition
        self._commit_errors: tuple[type[BaseException], ...] = (
            CommitFailedError,
            IllegalStateError,
            KafkaError,
            AssertionError,
        )

    def durable_producer(self) -> bool:
        """Does the broker's producer wait for every in-sync replica (``acks='all'``)?"""
        options = _compat.producer_options(self.broker)
        return options.get("acks") in ("all", -1) or bool(options.get("enable_idempotence"))

    def view(self, record: Any) -> Any:
        """``record`` with aiokafka's record attributes (``topic``, ``partition``, ``offset``,
        ``key``, ``value``, ``headers``): aiokafka's own record as it is."""
        return record

    def message_of(self, record: Any) -> ConsumerMessage:
        """The transport-neutral view of one record (``raw``: the client's own record)."""
        from consumer_idem.transports.kafka import to_message

        return to_message(self.view(record))

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        record = message.raw_message
        if not hasattr(record, "offset"):  # (a batch's tuple goes through members())
            raise IdempotencyConfigError("a Kafka Idempotency middleware got a non-Kafka message")
        return self.message_of(record)

    def check(self, subscriber: Any) -> None:
        # FastStream's max_workers with manual commits runs one consumer per worker (each
        # partition in order on one of them: it has ``consumer_subgroup``); any other
        # concurrency runs records of one partition side by side, and committing offset + 1 of
        # a finished record would commit past an earlier one still running.
        workers, apart = _compat.runs_partitions_apart(subscriber)
        if workers > 1 and not apart:
            raise IdempotencyConfigError(
                f"this Kafka subscriber runs max_workers={workers} records of one partition "
                "at once, so a commit could pass a record still running: use max_workers=1, "
                "or FastStream >= 0.5.34 with ack_policy=AckPolicy.MANUAL (concurrent between "
                "partitions only)"
            )

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        return str(self.view(message.raw_message).topic)

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        return None

    def permanent(self, exc: BaseException) -> bool:
        from consumer_idem.transports.kafka import PERMANENT_ERRORS

        return isinstance(exc, PERMANENT_ERRORS)

    async def ack(self, message: StreamMessage[Any]) -> None:
        record = self.view(message.raw_message)
        # This partition only, up to this record: FastStream's own ack commits every
        # partition's position, which may be ahead of what is done.
        offsets = {(record.topic, record.partition): record.offset + 1}
        # (not waiting for the broker's answer where the client can: the next record's commit
        # covers this one, and a lost one only delivers again what the keys replay)
        await self.commit(getattr(message, "consumer", None), offsets, wait=False)
        message.committed = AckStatus.ACKED

    async def commit(
        self, consumer: Any, offsets: dict[tuple[str, int], int], *, wait: bool = True
    ) -> None:
        """Commit ``{(topic, partition): next offset}`` through the delivery's consumer."""
        if isinstance(consumer, self._consumer_type):
            try:
                await self._commit_offsets(consumer, offsets, wait)
            except self._commit_errors as exc:
                # Rebalancing, or no longer ours: the next owner re-reads from the last commit
                # and meets completed records (replays), so nothing is lost or doubled.
                log.warning("commit of %s failed: %r", offsets, exc)
        elif consumer is not None and offsets:  # FastStream's test consumer: nothing to commit
            await consumer.commit()

    async def _commit_offsets(
        self, consumer: Any, offsets: dict[tuple[str, int], int], wait: bool
    ) -> None:
        # (aiokafka's commit always waits for the broker)
        await consumer.commit({self._tp(*tp): offset for tp, offset in offsets.items()})

    def commit_soon(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> None:
        """Commit in the background, the latest offsets first come: the subscriber fetches and
        runs its next batch instead of waiting for the broker (a few ms per commit). A commit
        that lags, or is lost when the consumer stops, only widens what is delivered again,
        and the keys make those replays (as ``KafkaRunner``'s background commits)."""
        if consumer is None or not offsets:
            return
        uncommitted = self._uncommitted.setdefault(id(consumer), {})
        for tp, offset in offsets.items():
            uncommitted[tp] = max(offset, uncommitted.get(tp, 0))
        if id(consumer) not in self._committers:
            task = asyncio.create_task(self._commit_latest(consumer))
            task.add_done_callback(_log_failure)
            self._committers[id(consumer)] = task

    async def _commit_latest(self, consumer: Any) -> None:
        try:
            while offsets := self._uncommitted.pop(id(consumer), None):
                await self.commit(consumer, offsets, wait=False)  # (as ack(): lost = replayed)
        finally:
            self._committers.pop(id(consumer), None)
            self._uncommitted.pop(id(consumer), None)  # (cancelled: delivered again instead)

    async def seek(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> None:
        """Deliver each partition again from ``offsets[(topic, partition)]``."""
        if consumer is None:
            return
        for tp, offset in offsets.items():
            try:
                await self._seek_one(consumer, tp, offset)
            except self._commit_errors as exc:  # revoked meanwhile: its next owner re-reads it
                log.warning("seek of %s/%s to %s failed: %r", *tp, offset, exc)

    async def _seek_one(self, consumer: Any, tp: tuple[str, int], offset: int) -> None:
        consumer.seek(self._tp(*tp), offset)

    async def retry(self, message: StreamMessage[Any]) -> None:
        await message.nack()  # seeks back to this record: it is the next one fetched

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        raise NotImplementedError("Kafka does not hold waits: a seek back costs nothing")

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None:
        await self.dead_letter_record(
            message.raw_message, verdict, to, body_dropped, message.correlation_id
        )

    async def dead_letter_record(
        self,
        record: Any,
        verdict: Verdict,
        to: str,
        body_dropped: bool = False,
        correlation_id: str | None = None,
    ) -> None:
        """One record to ``to``, as ``KafkaRunner`` dead-letters it (a batch member too)."""
        from consumer_idem.transports.kafka import dead_letter_headers

        record = self.view(record)
        await self.publish(
            to,
            b"" if body_dropped else record.value,
            record.key,
            dead_letter_headers(record, verdict, body_dropped),
            correlation_id,
        )

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self.publish(
            self.idem.reconcile_destination,
            body,
            f"{scope}/{key}".encode(),
            [(SCOPE_HEADER, scope.encode()), (KEY_HEADER, key.encode())],
        )

    async def redispatch(self, notice: Notice) -> None:
        """The original as it was: record key, body, headers with its original coordinates
        (the same as ``KafkaRunner``'s re-dispatch)."""
        from consumer_idem.transports.kafka import redispatch_headers

        assert notice.source is not None
        await self.publish(
            notice.source, notice.body, notice.record_key, redispatch_headers(notice)
        )

    async def publish(
        self,
        topic: str,
        body: bytes | None,
        key: bytes | None,
        headers: Sequence[tuple[str, bytes]],
        correlation_id: str | None = None,
    ) -> None:
        # FastStream sends header values as text: bytes that are not UTF-8 go backslash-escaped
        text = {name: value.decode("utf-8", "backslashreplace") for name, value in headers}
        await self.broker.publish(
            body or b"", topic, key=key, headers=text, correlation_id=correlation_id
        )


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("background commit failed: %r", exc, exc_info=exc)
