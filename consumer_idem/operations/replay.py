"""Dead-letter replay: run dead-lettered messages through the same idempotent handler.

Completed keys are skipped (replayed, not run), ``unknown`` keys are not executed (reported:
reconciliation owns them), the rest execute exactly once. ``dry_run`` only counts what would
happen. Kafka replays read with their own consumer group, up to the end offsets seen at start,
and commit as they go, so an interrupted replay resumes where it stopped; RabbitMQ replays take
the messages present at start and ack as they go (a message that fails again is put back).
A dead-letter copy keeps its identity: our runners keep the original headers (the idempotency
key) and add the original coordinates, which ``kafka_coordinates()`` uses.

A copy whose outcome is ``unknown`` (its replay parked the key, or met it parked) is acked only
once its original is kept in the store, as the runners do (``settle.keep_original``): a "not
executed" answer then re-dispatches it to the topic or queue it *first* came from (its
``x-original-topic`` / Spring's ``kafka_dlt-original-topic`` / ``x-original-queue`` header),
without the dead-letter headers. If it cannot be kept, it is reported ``failed`` and not acked.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from consumer_idem.consumer import (
    DEAD_LETTER_ERROR,
    DEAD_LETTER_KEY,
    DEAD_LETTER_REASON,
    DEAD_LETTER_SCOPE,
    Action,
    IdempotentConsumer,
    Verdict,
    notice_reason,
)
from consumer_idem.errors import ConsumerIdemError, InvalidKey
from consumer_idem.key_strategies import original_coordinates
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import ORIGINAL_QUEUE, Notice, make_notice
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports.settle import DEAD_LETTER_BODY_DROPPED, is_unknown
from consumer_idem.types import Status

log = logging.getLogger("consumer_idem.operations.replay")

#: classification of one message, as the dry run predicts it and the replay reports it
CATEGORIES = ("execute", "skip", "unknown", "in_progress", "misuse", "invalid", "failed")


@dataclass
class ReplayReport:
    read: int = 0
    execute: int = 0  #: ran now (dry run: would run)
    skip: int = 0  #: already completed: not run again
    unknown: int = 0  #: parked for reconciliation: not run
    in_progress: int = 0  #: someone holds a live lease on it
    misuse: int = 0  #: same key, another payload
    invalid: int = 0  #: no valid key, or a body the consumer cannot read
    failed: int = 0  #: ran and failed again (left in the dead-letter destination)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, category: str) -> None:
        self.read += 1
        setattr(self, category, getattr(self, category) + 1)


def load_target(spec: str) -> Any:
    """The object named by ``module:attribute`` (a clear error if it cannot be found)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected module:function, not {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc


def load_consumer(spec: str, store: PostgresStore) -> IdempotentConsumer:
    """``module:attribute`` naming an :class:`IdempotentConsumer`, or a function taking the
    store and returning one (so the replay uses the operator's store settings)."""
    target = load_target(spec)
    consumer = target if isinstance(target, IdempotentConsumer) else target(store)
    if not isinstance(consumer, IdempotentConsumer):
        raise TypeError(f"{spec} did not give an IdempotentConsumer (got {type(consumer)})")
    return consumer


async def classify(consumer: IdempotentConsumer, message: ConsumerMessage) -> str:
    """What replaying ``message`` would do, read from the store without changing it."""
    prepared = consumer.prepare(message)
    if isinstance(prepared, Verdict):
        return "invalid"
    key, fingerprint = prepared
    record = await consumer.store.get(consumer.scope, key)
    if record is None or record.status is Status.EXPIRED:
        return "execute"
    if record.fingerprint != fingerprint:
        return "misuse"
    return {
        Status.COMPLETED: "skip",
        Status.UNKNOWN: "unknown",
        Status.IN_PROGRESS: "in_progress",
        Status.FAILED_RETRYABLE: "execute",
    }[record.status]


def category_of(verdict: Verdict) -> str:
    if verdict.action is Action.RETRY:
        return "in_progress" if verdict.reason == "in_progress" else "failed"
    if verdict.action is Action.DEAD_LETTER:
        if verdict.reason == "key_misuse":
            return "misuse"
        if verdict.reason and verdict.reason.startswith(("invalid_key", "invalid_json")):
            return "invalid"
        return "failed"
    if verdict.reason == "unknown":  # its notice, if new, is published by the sweeper; its
        # original is kept before the ack (keep_replayed)
        return "unknown"
    return "skip" if verdict.duplicate else "execute"


Ack = Callable[[bool], Awaitable[None]]  # ack(settled): True = done with it, False = keep it

#: headers a dead-letter copy gained, which its re-dispatched original does not carry
DEAD_LETTER_HEADERS = frozenset(
    {
        DEAD_LETTER_REASON,
        DEAD_LETTER_SCOPE,
        DEAD_LETTER_KEY,
        DEAD_LETTER_ERROR,
        DEAD_LETTER_BODY_DROPPED,
    }
)


def original_source(message: ConsumerMessage) -> str | None:
    """The topic or queue a dead-letter copy first came from: its ``x-original-topic`` (or
    Spring's) or ``x-original-queue`` header. Without one, a Kafka copy's own topic (the
    re-dispatch then lands in the dead-letter topic, where the next replay finds it); else
    None."""
    try:
        coordinates = original_coordinates(message)
    except InvalidKey:
        coordinates = None
    if coordinates is not None:
        return coordinates[0]
    queue = message.header(ORIGINAL_QUEUE)
    if queue:
        return queue.decode("utf-8", "replace")
    return message.topic


def dead_letter_original(
    scope: str, key: str, reason: str | None, message: ConsumerMessage
) -> Notice:
    """The original message of a dead-letter copy, as a notice to keep: sent back to where it
    first came from, with its headers (and original coordinates), record key and AMQP
    properties, without the dead-letter headers."""
    source = original_source(message)
    if source is None:
        return Notice(scope, key, reason)
    headers = {k: v for k, v in message.headers.items() if k.lower() not in DEAD_LETTER_HEADERS}
    return make_notice(
        scope,
        key,
        reason,
        source=source,
        original=replace(message, headers=headers),
        properties=_amqp_properties(message),
    )


def _amqp_properties(message: ConsumerMessage) -> dict[str, Any] | None:
    try:
        from aio_pika.abc import AbstractIncomingMessage
    except ImportError:  # pragma: no cover - the rabbit extra is not installed
        return None
    if not isinstance(message.raw, AbstractIncomingMessage):
        return None
    from consumer_idem.transports.rabbit import amqp_properties

    return amqp_properties(message.raw)


async def keep_replayed(
    consumer: IdempotentConsumer, message: ConsumerMessage, verdict: Verdict
) -> bool:
    """Keep the original of a replayed copy whose outcome is ``unknown`` before it is acked
    (see the module docstring). True when it may be acked."""
    assert verdict.key is not None
    keep = getattr(consumer.store, "keep_original", None)
    if keep is None:  # a store without the outbox (Redis): reconciliation is Postgres-only
        return True
    notice = dead_letter_original(consumer.scope, verdict.key, notice_reason(verdict), message)
    extra = {"scope": consumer.scope, "key": verdict.key}
    if not notice.original:
        log.error("no origin for an unknown outcome's copy: left in place", extra=extra)
        return False
    try:
        status = await keep(consumer.scope, verdict.key, notice)
    except ConsumerIdemError as exc:
        log.warning("could not keep the original (%s): left in place", exc, extra=extra)
        return False
    return status in (Status.UNKNOWN, Status.COMPLETED)


async def replay(
    consumer: IdempotentConsumer,
    source: AsyncIterator[tuple[ConsumerMessage, Ack]],
    *,
    dry_run: bool = False,
    rate: float | None = None,
    on_progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """Replay every message ``source`` yields; see the module docstring."""
    report = ReplayReport()
    started = time.monotonic()
    async for message, ack in source:
        if rate:
            wait = started + report.read / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        if dry_run:
            report.add(await classify(consumer, message))
            await ack(False)
        else:
            verdict = await consumer.process(message)
            category = category_of(verdict)
            if is_unknown(verdict) and not await keep_replayed(consumer, message, verdict):
                category = "failed"  # not kept: not acked either
            report.add(category)
            await ack(category not in ("failed", "in_progress"))
        if on_progress is not None:
            on_progress(report)
    return report


# --- sources ------------------------------------------------------------------------------------


async def kafka_source(
    topic: str, *, group_id: str, bootstrap_servers: str, commit: bool = True
) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
    """Records of ``topic`` from the group's committed offsets up to the end offsets seen at
    start; each settled record's offset is committed (resumable), unless ``commit`` is False."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from consumer_idem.transports.kafka import to_message

    kafka = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await kafka.start()
    try:
        partitions = await _partitions(topic, bootstrap_servers)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        kafka.assign(tps)
        ends = await kafka.end_offsets(tps)
        for tp in tps:
            done = await kafka.committed(tp)
            if done is None:
                await kafka.seek_to_beginning(tp)
            else:
                kafka.seek(tp, done)
        remaining = {tp for tp in tps if await kafka.position(tp) < ends[tp]}
        settled: dict[Any, int] = {}
        while remaining:
            batch = await kafka.getmany(*remaining, timeout_ms=1000)
            for tp, records in batch.items():
                for record in records:
                    if record.offset >= ends[tp]:
                        break

                    async def ack(
                        settled_ok: bool, tp: Any = tp, offset: int = record.offset
                    ) -> None:
                        # a replayed failure stays in the topic (reported); the replay moves on
                        settled[tp] = offset + 1

                    yield to_message(record), ack
            if commit and settled:  # once per fetched batch: resuming re-reads at most that
                await kafka.commit(dict(settled))
            remaining = {tp for tp in remaining if await kafka.position(tp) < ends[tp]}
    finally:
        await kafka.stop()


async def rabbit_source(
    queue: str, *, url: str, requeue_all: bool = False
) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
    """The messages in ``queue`` at start. Settled ones are acked; the rest (and, with
    ``requeue_all`` for a dry run, all of them) go back to the queue at the end."""
    import aio_pika

    from consumer_idem.transports.rabbit import to_message

    connection = await aio_pika.connect(url)
    held: list[Any] = []
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        count = q.declaration_result.message_count or 0
        for _ in range(count):
            incoming = await q.get(no_ack=False, fail=False)
            if incoming is None:
                break

            async def ack(settled: bool, incoming: Any = incoming) -> None:
                if settled and not requeue_all:
                    await incoming.ack()
                else:
                    held.append(incoming)  # back to the queue once the pass is over

            yield to_message(incoming), ack
        for incoming in held:
            await incoming.nack(requeue=True)
    finally:
        await connection.close()


def report_row(report: ReplayReport) -> dict[str, Any]:
    return {k: v for k, v in report.as_dict().items() if v or k in ("read", "execute", "skip")}


async def _partitions(topic: str, bootstrap_servers: str) -> list[int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    found = [d for d in described if d.get("topic") == topic and not d.get("error_code")]
    if not found:
        raise LookupError(f"topic {topic!r} does not exist")
    return sorted(p["partition"] for p in found[0]["partitions"])
