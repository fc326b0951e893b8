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
without the dead-letter headers. If it cannot be kept, it is reported ``failed``.

Nothing read is lost from view. A message the replay does not settle (it failed again, someone
holds its key, it is a key misuse, it has no valid key, or its original could not be kept) is
dead-lettered again to the topic or queue being replayed, with the reason in its
``x-dead-letter-reason`` / ``x-dead-letter-error`` headers, and only then acked or committed
past: the next replay, with the same group, meets it again. The report counts and lists them
(``problems``), and each is one WARNING log line. A dry run reads without changing anything and
logs nothing.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

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


#: what becomes of each category in a real run: settled (acked / committed past) or, not
#: settled, dead-lettered again to the replayed topic or queue with the reason
SETTLED = frozenset({"execute", "skip", "unknown"})
#: problems kept in a report (each one is logged as well; the count is always exact)
MAX_PROBLEMS = 1000


@dataclass(frozen=True, slots=True)
class ReplayProblem:
    """A message the replay did not settle (or, in a dry run, would not)."""

    category: str  #: in_progress, misuse, invalid or failed
    scope: str
    key: str | None
    reason: str | None  #: the verdict's reason (``failed_retryable``, ``key_misuse``...)
    error: str | None  #: the error behind it, when there is one
    position: str  #: where it was read: ``topic[partition]@offset`` or the queue


@dataclass
class ReplayReport:
    """A replay's progress and ending: how many messages went each way (see
    `CATEGORIES`). Updated as the replay runs."""

    read: int = 0
    execute: int = 0  #: ran now (dry run: would run)
    skip: int = 0  #: already completed: not run again
    unknown: int = 0  #: parked for reconciliation: not run
    in_progress: int = 0  #: someone holds a live lease on it
    misuse: int = 0  #: same key, another payload
    invalid: int = 0  #: no valid key, or a body the consumer cannot read
    failed: int = 0  #: ran and failed again
    #: not settled, so dead-lettered again to the replayed destination with the reason (a
    #: later replay meets them again); 0 in a dry run, which leaves every message in place
    redead_lettered: int = 0
    #: how many messages the source holds for this replay, when it can tell
    total: int | None = None
    #: stopped early (a signal): what was read is settled, the rest is left for the next run
    interrupted: bool = False
    problems: list[ReplayProblem] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add(self, category: str) -> None:
        self.read += 1
        setattr(self, category, getattr(self, category) + 1)

    @property
    def unsettled(self) -> int:
        """Messages read and not settled (or, in a dry run, that would not be)."""
        return self.in_progress + self.misuse + self.invalid + self.failed

    def note(self, problem: ReplayProblem) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)


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
    """``module:attribute`` naming an [`IdempotentConsumer`][consumer_idem.IdempotentConsumer], or a
    function taking the
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
    outbox = getattr(consumer.store, "redispatch", None)
    if outbox is None:  # a store without the outbox (Redis): reconciliation is Postgres-only
        return True
    keep = outbox.keep_original
    notice = dead_letter_original(consumer.scope, verdict.key, notice_reason(verdict), message)
    extra = {"scope": consumer.scope, "key": verdict.key}
    if not notice.original:
        log.error(
            "scope=%s key=%s: no origin for an unknown outcome's copy: not acked",
            consumer.scope,
            verdict.key,
            extra=extra,
        )
        return False
    try:
        status = await keep(consumer.scope, verdict.key, notice)
    except ConsumerIdemError as exc:
        log.warning(
            "scope=%s key=%s: could not keep the original (%s): not acked",
            consumer.scope,
            verdict.key,
            exc,
            extra=extra,
        )
        return False
    return status in (Status.UNKNOWN, Status.COMPLETED)


class Ack(Protocol):
    """Settle one message of a replay source.

    ``ack(True)``: done with it (ack it, or commit past it). ``ack(False)``: leave it exactly as
    it is (a dry run). ``ack(False, verdict)``: it was not settled: put it back where a later
    replay finds it, with the verdict's reason (both sources publish a copy, confirmed, to the
    replayed topic or queue, then ack the original). Raises if that cannot be done; the
    message is then neither acked nor committed past."""

    async def __call__(self, settled: bool, verdict: Verdict | None = None, /) -> None: ...


def position(message: ConsumerMessage) -> str:
    """Where a message was read, for an operator: ``topic[partition]@offset`` or the queue."""
    if message.topic is not None and message.offset is not None:
        return f"{message.topic}[{message.partition}]@{message.offset}"
    queue = message.header(ORIGINAL_QUEUE)
    return f"queue (from {queue.decode('utf-8', 'replace')})" if queue else "queue"


def unsettled_verdict(verdict: Verdict) -> Verdict:
    """The verdict a copy put back carries in its dead-letter headers: the reason, and the error
    behind a retry (a retry verdict carries none of its own)."""
    error = verdict.error
    if error is None and verdict.outcome is not None and verdict.outcome.error is not None:
        cause = verdict.outcome.error
        error = f"{type(cause).__name__}: {cause}"
    return replace(verdict, reason=verdict.reason or "replay_failed", error=error)


async def replay(
    consumer: IdempotentConsumer,
    source: AsyncIterable[tuple[ConsumerMessage, Ack]],
    *,
    dry_run: bool = False,
    rate: float | None = None,
    on_progress: Callable[[ReplayReport], None] | None = None,
    stop: asyncio.Event | None = None,
) -> ReplayReport:
    """Replay every message ``source`` yields; see the module docstring. ``stop``: set it to
    end the replay after the message in hand (``interrupted`` in the report)."""
    report = ReplayReport()
    started = time.monotonic()
    messages = aiter(source)
    try:
        async for message, ack in messages:
            report.total = getattr(source, "total", None)
            if rate:
                wait = started + report.read / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            if dry_run:
                category = await classify(consumer, message)
                report.add(category)
                if category not in SETTLED:
                    report.note(
                        ReplayProblem(category, consumer.scope, None, None, None, position(message))
                    )
                await ack(False)
            else:
                await _replay_one(consumer, message, ack, report)
            if on_progress is not None:
                on_progress(report)
            if stop is not None and stop.is_set():
                report.interrupted = True
                break
    finally:
        closing = getattr(messages, "aclose", None)
        if closing is not None:  # commits what was settled (Kafka), puts back what was held
            await closing()
    report.total = getattr(source, "total", None)
    return report


async def _replay_one(
    consumer: IdempotentConsumer, message: ConsumerMessage, ack: Ack, report: ReplayReport
) -> None:
    verdict = await consumer.process(message)
    category = category_of(verdict)
    if is_unknown(verdict) and not await keep_replayed(consumer, message, verdict):
        category = "failed"  # its original could not be kept: not acked either
        verdict = replace(verdict, reason="original_not_kept")
    if category in SETTLED:
        report.add(category)
        await ack(True)
        return
    put_back = unsettled_verdict(verdict)
    await ack(False, put_back)
    report.add(category)
    report.redead_lettered += 1
    report.note(
        ReplayProblem(
            category,
            put_back.scope,
            put_back.key,
            put_back.reason,
            put_back.error,
            position(message),
        )
    )
    log.warning(
        "scope=%s key=%s: replay did not settle it (%s: %s%s); dead-lettered again to its "
        "source, for a later replay",
        put_back.scope,
        put_back.key,
        category,
        put_back.reason,
        f", {put_back.error}" if put_back.error else "",
        extra={"scope": put_back.scope, "key": put_back.key},
    )


# --- sources ------------------------------------------------------------------------------------


class KafkaSource:
    """Records of ``topic`` from the group's committed offsets up to the end offsets seen at
    start; each settled record's offset is committed (resumable), unless ``commit`` is False
    (a dry run). A record put back (``ack(False, verdict)``) is first published again to the
    end of ``topic`` (same key and headers, its original coordinates, the new reason;
    acknowledged by all in-sync replicas), so the group moves past it without losing it."""

    def __init__(
        self, topic: str, *, group_id: str, bootstrap_servers: str, commit: bool = True
    ) -> None:
        self.topic = topic
        self.group_id = group_id
        self.bootstrap_servers = bootstrap_servers
        self.commit = commit
        #: records to read (set once the source has started)
        self.total: int | None = None

    def __aiter__(self) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
        return self._records()

    async def _records(self) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        from consumer_idem.transports.kafka import dead_letter_headers, to_message

        kafka = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        producer: AIOKafkaProducer | None = None
        settled: dict[Any, int] = {}
        try:
            await kafka.start()
        except BaseException:
            await kafka.stop()  # a client that never started must still be closed
            raise
        try:
            partitions = await _partitions(self.topic, self.bootstrap_servers)
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            kafka.assign(tps)
            ends = await kafka.end_offsets(tps)
            for tp in tps:
                done = await kafka.committed(tp)
                if done is None:
                    await kafka.seek_to_beginning(tp)
                else:
                    kafka.seek(tp, done)
            starts = {tp: await kafka.position(tp) for tp in tps}
            self.total = sum(max(0, ends[tp] - starts[tp]) for tp in tps)
            remaining = {tp for tp in tps if starts[tp] < ends[tp]}
            while remaining:
                batch = await kafka.getmany(*remaining, timeout_ms=1000)
                for tp, records in batch.items():
                    for record in records:
                        if record.offset >= ends[tp]:
                            break

                        async def ack(
                            settled_ok: bool,
                            verdict: Verdict | None = None,
                            /,
                            tp: Any = tp,
                            record: Any = record,
                        ) -> None:
                            nonlocal producer
                            if not self.commit or (not settled_ok and verdict is None):
                                return  # a dry run: nothing committed, nothing moved
                            if not settled_ok and verdict is not None:
                                if producer is None:
                                    producer = AIOKafkaProducer(
                                        bootstrap_servers=self.bootstrap_servers, acks="all"
                                    )
                                    await producer.start()
                                await producer.send_and_wait(
                                    self.topic,
                                    value=record.value,
                                    key=record.key,
                                    headers=dead_letter_headers(record, verdict),
                                )
                            settled[tp] = record.offset + 1

                        yield to_message(record), ack
                if self.commit and settled:  # once per fetched batch: resuming re-reads at
                    await kafka.commit(dict(settled))  # most that batch
                remaining = {tp for tp in remaining if await kafka.position(tp) < ends[tp]}
        finally:
            try:
                if self.commit and settled:  # stopped early: keep what was done
                    await kafka.commit(dict(settled))
            finally:
                if producer is not None:
                    await producer.stop()
                await kafka.stop()


def kafka_source(
    topic: str, *, group_id: str, bootstrap_servers: str, commit: bool = True
) -> KafkaSource:
    """A [`KafkaSource`][consumer_idem.operations.replay.KafkaSource] (see there)."""
    return KafkaSource(topic, group_id=group_id, bootstrap_servers=bootstrap_servers, commit=commit)


class RabbitSource:
    """The messages in ``queue`` at start. Settled ones are acked; one put back
    (``ack(False, verdict)``) is published again to the tail of the queue (its properties and
    headers, the new reason; confirmed) and the original acked. With ``requeue_all`` (a dry
    run) every message goes back to the queue untouched at the end."""

    def __init__(self, queue: str, *, url: str, requeue_all: bool = False) -> None:
        self.queue = queue
        self.url = url
        self.requeue_all = requeue_all
        #: messages to read (set once the source has started)
        self.total: int | None = None

    def __aiter__(self) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[tuple[ConsumerMessage, Ack]]:
        import aio_pika

        from consumer_idem.notice import clean_properties
        from consumer_idem.transports.rabbit import (
            amqp_properties,
            dead_letter_headers,
            redispatch_properties,
            to_message,
        )

        connection = await aio_pika.connect(self.url)
        held: list[Any] = []
        try:
            channel = await connection.channel(publisher_confirms=True)
            q = await channel.declare_queue(self.queue, passive=True)
            self.total = count = q.declaration_result.message_count or 0
            for _ in range(count):
                incoming = await q.get(no_ack=False, fail=False)
                if incoming is None:
                    break

                async def ack(
                    settled: bool, verdict: Verdict | None = None, /, incoming: Any = incoming
                ) -> None:
                    if self.requeue_all or (not settled and verdict is None):
                        held.append(incoming)  # back to the queue, untouched, once the pass ends
                        return
                    if not settled:
                        assert verdict is not None
                        headers = {
                            k: v
                            for k, v in dead_letter_headers(incoming, verdict, self.queue).items()
                            if not k.startswith("x-delivery")  # the broker's own count
                        }
                        properties = clean_properties(amqp_properties(incoming))
                        copy = aio_pika.Message(
                            incoming.body,
                            headers=headers,
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                            **redispatch_properties(Notice("", "", properties=properties)),
                        )
                        await channel.default_exchange.publish(copy, routing_key=self.queue)
                    await incoming.ack()

                yield to_message(incoming), ack
        finally:
            try:
                for incoming in held:
                    await incoming.nack(requeue=True)
            finally:
                await connection.close()


def rabbit_source(queue: str, *, url: str, requeue_all: bool = False) -> RabbitSource:
    """A [`RabbitSource`][consumer_idem.operations.replay.RabbitSource] (see there)."""
    return RabbitSource(queue, url=url, requeue_all=requeue_all)


def report_row(report: ReplayReport) -> dict[str, int]:
    """The counts worth showing: read, executed, skipped, and every other one that happened."""
    counts = {
        k: v
        for k, v in report.as_dict().items()
        if isinstance(v, int) and not isinstance(v, bool) and k != "total"
    }
    return {k: v for k, v in counts.items() if v or k in ("read", "execute", "skip")}


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
