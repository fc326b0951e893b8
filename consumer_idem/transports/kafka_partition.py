"""One assigned Kafka partition and its worker: what lives as long as the assignment.

A `Partition` holds the records fetched for it and not yet settled, runs them through the
consumer in chunks (in order: a record to retry holds back the ones after it), and commits the
contiguous prefix of what is settled, in the background. The runner
([`KafkaRunner`][consumer_idem.transports.kafka.KafkaRunner]) fetches, dispatches, starts and stops
partitions on rebalances, and carries verdicts out (the settle path's transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from consumer_idem.backoff import Backoff
from consumer_idem.consumer import Action, IdempotentConsumer, Verdict
from consumer_idem.errors import ConsumerIdemError
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle
from consumer_idem.transports.kafka_offsets import record_mark
from consumer_idem.transports.settle import Settled

if TYPE_CHECKING:
    from consumer_idem.transports.kafka import KafkaRunner

log = logging.getLogger("consumer_idem.transports.kafka")

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"

#: how long a partition whose worker failed waits before it is restarted
RESTART_BACKOFF = Backoff(1.0, 60.0)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One record of a partition, as the settle path carries it."""

    part: Partition
    record: Record


class Partition:
    """An assigned partition: its pending records, its worker and its commits."""

    def __init__(self, runner: KafkaRunner, tp: TopicPartition) -> None:
        self.runner = runner
        self.tp = tp
        #: fetched and not yet settled, in offset order
        self.pending: deque[Record] = deque()
        self.task: asyncio.Task[None] | None = None
        self.revoked = False
        self.paused = False
        #: next offset to commit: last settled offset + 1
        self.done: int | None = None
        #: the record before ``done`` (its mark is stored with the offset in Postgres)
        self.done_record: Record | None = None
        self.committed: int | None = None
        self.wake = asyncio.Event()
        #: consecutive worker failures (restart backoff)
        self.failures = 0
        #: fetched records not yet looked at by the preparer, and the messages it prepared
        #: ahead (by offset), for records after ``taken`` (the last offset handed over)
        self.unprepared: deque[Record] = deque()
        self.ahead: dict[int, ConsumerMessage] = {}
        self.taken = -1
        self.preparer: asyncio.Task[None] | None = None
        #: one offset commit at a time (in order); the worker's run in the background
        self.commit_lock = asyncio.Lock()
        self.committer: asyncio.Task[None] | None = None

    def over(self) -> bool:
        """Nothing more for the worker to do here: revoked, or the runner stops."""
        return self.revoked or self.runner.stopping()

    # --- records in ----------------------------------------------------------------------------

    def add(self, records: list[Record]) -> None:
        """Fetched records: queued, the worker started (or restarted), and their keys prepared
        ahead of it."""
        runner = self.runner
        self.pending.extend(records)
        if len(self.pending) >= 2 * runner.max_records and not self.paused:
            runner.pause(self.tp)  # backpressure: stop fetching what we cannot keep up with
            self.paused = True
        self.reap()  # a dead worker is looked at before anything replaces it
        if self.task is None:
            self.task = asyncio.create_task(self.work(), name=f"consumer-idem {self.tp}")
        if runner.prepare is not None:
            self.unprepared.extend(records)
            if self.preparer is None or self.preparer.done():
                self.preparer = asyncio.create_task(
                    self._prepare_ahead(), name=f"consumer-idem prepare {self.tp}"
                )

    async def _prepare_ahead(self) -> None:
        """Messages, keys and fingerprints of fetched records, computed while the worker waits
        for Postgres (that CPU then overlaps the database's instead of adding to it). In
        slices, so the worker resumes as soon as its answer is in."""
        prepare = self.runner.prepare
        assert prepare is not None
        done = 0
        while self.unprepared and not self.over():
            record = self.unprepared.popleft()
            if record.offset <= self.taken:  # the worker got there first
                continue
            message = self.runner.to_message(record)
            with contextlib.suppress(Exception):  # the worker meets it again and decides
                prepare(message)
            self.ahead[record.offset] = message
            done += 1
            if done % 32 == 0:
                await asyncio.sleep(0)

    def _messages(self, chunk: list[Record]) -> list[ConsumerMessage]:
        """The chunk as messages: those prepared ahead, fresh ones for the rest (and for a
        record seen before: a retried record's earlier message may carry its handler's
        changes)."""
        ahead, fresh = self.ahead, self.runner.to_message
        messages = [ahead.pop(r.offset) if r.offset in ahead else fresh(r) for r in chunk]
        self.taken = max(self.taken, chunk[-1].offset)
        return messages

    # --- the worker ----------------------------------------------------------------------------

    def reap(self) -> None:
        """Look at a finished worker. One that failed is logged with its traceback and
        restarted (after a backoff, in `work`) from the partition's first unsettled
        record: records are only removed from ``pending`` once settled, and nothing after the
        first unsettled one is ever committed, so no record is skipped or committed unrun."""
        task = self.task
        if task is None or not task.done():
            return
        self.task = None
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.runner.stats.failures += 1
        self.failures += 1
        head = self.pending[0].offset if self.pending else None
        log.error(
            "worker of %s failed; restarting it at offset %s (nothing after it is committed)",
            self.tp,
            head,
            exc_info=exc,
        )
        if self.pending and not self.over():
            self.task = asyncio.create_task(self.work(), name=f"consumer-idem {self.tp}")

    async def work(self) -> None:
        """The partition's worker: its pending records, a chunk at a time, until none is left.
        The consumer is called from here, not from a helper: the handler runs as few frames
        below the worker as it can (``tests/test_handler_depth.py``)."""
        if self.failures:  # restarted after a failure: back off first (without holding a slot)
            await settle.pause(RESTART_BACKOFF.delay(self.failures), self.over)
        runner = self.runner
        consumer, hook = runner.consumer, runner.hook
        while self.pending and not self.over():
            # A slot per chunk, not per partition: a partition with a backlog lets the others
            # in between its chunks, and one waiting to retry (below) holds no slot at all.
            async with runner.slots:
                if not self.pending or self.over():
                    return
                chunk = [self.pending[i] for i in range(min(runner.chunk, len(self.pending)))]
                messages = self._messages(chunk)
                if hook is not None:  # the offset commits with the effects
                    assert isinstance(consumer, IdempotentConsumer)
                    verdicts = await consumer.process_batch(messages, hook)
                else:
                    verdicts = await consumer.process_batch(messages)
                held = await self._settle(chunk, verdicts)
            if held is None:  # stopping before a publish was confirmed
                return
            if held:
                retry, wait = held
                await settle.settle(runner, retry, wait)

    async def _settle(
        self, chunk: list[Record], verdicts: list[Verdict]
    ) -> tuple[Delivery, Verdict] | tuple[()] | None:
        """The chunk's verdicts carried out in order, up to the first record to retry
        (returned with its verdict, to wait for outside the slot); None when a record was left
        unsettled (stopping). Then the settled prefix is committed in the background."""
        runner = self.runner
        held: tuple[Delivery, Verdict] | tuple[()] | None = ()
        for record, verdict in zip(chunk, verdicts, strict=False):
            if verdict.action is Action.RETRY:  # it and all after it wait (order)
                held = (Delivery(self, record), verdict)
                break
            outcome = await settle.settle(runner, Delivery(self, record), verdict)
            if outcome is Settled.RETRY:  # not acked (its original could not be kept):
                break  # processed again from this record, after the wait it took
            if outcome is not Settled.ACKED:
                held = None  # stopping before its publish was confirmed
                break
        self.commit_soon()
        if self.paused and len(self.pending) < runner.max_records and not self.revoked:
            runner.resume(self.tp)
            self.paused = False
        return held

    # --- settling (the runner's transport calls) -----------------------------------------------

    def acked(self, record: Record) -> None:
        """The offset may be committed now; the worker commits the contiguous prefix."""
        assert self.pending and self.pending[0] is record, "settled out of order"
        self.pending.popleft()
        self.done, self.done_record = record.offset + 1, record
        self.failures = 0

    async def wait(self, seconds: float) -> None:
        """Not committed: the partition waits (its later records too, to keep the order), or
        until woken (revoked, stopping)."""
        self.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=seconds)

    # --- commits -------------------------------------------------------------------------------

    async def commit(self) -> None:
        if self.done is None:
            return
        runner = self.runner
        offset: int | None = self.done
        if runner.offsets is not None:  # Postgres first; Kafka's copy is advisory (lag)
            mark = None if self.done_record is None else record_mark(self.done_record)
            offset = await self._save_offset(self.done, mark)
        if offset is None:
            return
        async with self.commit_lock:
            if offset == self.committed or (self.committed or 0) > offset:
                return  # a later commit got there first
            try:
                await runner.commit_offset(self.tp, offset)
            except (KafkaError, AssertionError) as exc:
                # Rebalancing, or no longer ours: the next owner re-reads from the last commit
                # and meets completed records (replays), so nothing is lost or doubled.
                log.warning("commit of %s@%d failed: %r", self.tp, offset, exc)
                return
            self.committed = offset
            runner.stats.commits += 1

    def commit_soon(self) -> None:
        """Commit in the background: the worker goes on with its next chunk instead of
        waiting for the broker (a few ms per commit). Stopping and revocations commit (and
        wait) themselves; a commit that lags only widens what a crash makes the next owner read
        again, and the keys make those replays."""
        if self.committer is None or self.committer.done():
            self.committer = asyncio.create_task(self._commit_latest())

    async def _commit_latest(self) -> None:
        while True:
            done = self.done
            await self.commit()
            if self.done == done or self.over():
                return

    async def _save_offset(self, done: int, mark: str | None) -> int | None:
        """Store ``done`` (and ``mark``, the record before it) as the partition's next offset in
        Postgres, unless a transaction already did; returns what Postgres holds now (None:
        nothing yet)."""
        offsets, stored_by_tp = self.runner.offsets, self.runner.stored
        assert offsets is not None
        tp = (self.tp.topic, self.tp.partition)
        stored = stored_by_tp.get(tp)
        if stored is not None and stored >= done:
            return stored
        try:
            await offsets.save({tp: (done, mark)})
        except ConsumerIdemError as exc:  # the next commit tries again; keys cover a crash
            log.warning("storing the offset of %s@%d failed: %s", self.tp, done, exc)
            return stored
        stored_by_tp[tp] = done
        return done
