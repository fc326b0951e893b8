"""FastStream integration: idempotent subscribers on ``KafkaBroker`` and ``RabbitBroker``.

:class:`Idempotency` is a FastStream middleware. Put it on a router (one per scope) or on the
broker, and subscribe with ``ack_policy=AckPolicy.MANUAL``::

    idem = Idempotency(store, broker=broker, scope="payments.ledger")
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("payments", group_id="ledger", ack_policy=AckPolicy.MANUAL)
    @router.publisher("payments.recorded")
    async def record(body: dict, conn: IdempotentConnection) -> dict:
        await conn.execute("INSERT ...")  # commits with the idempotency record
        return {"recorded": body["payment_id"]}

    broker.include_router(router)

For each delivery the middleware, wrapped around FastStream's handler call:

1. derives the key from the *raw* message (Kafka header bytes and coordinates, AMQP properties)
   through the same key strategies as ``@idempotent_consumer``; FastStream's ``message_id`` is
   never used (it is a fresh UUID when the producer set none);
2. claims the key, runs the handler and stores its return value in one transaction (or under a
   lease in two-phase mode); the handler reaches the open connection through FastStream's own
   injection (:data:`IdempotentConnection`, :data:`IdempotentAttempt`, :data:`CurrentIdempotency`);
3. returns the stored value to FastStream, so the subscriber's publishers publish it; a duplicate
   returns the stored value without calling the handler, so they publish the same bytes again;
4. settles the delivery only after that: a Kafka commit of ``offset + 1`` of that one partition
   (never "commit everything"), an AMQP ack. Dead letters and reconciliation notices are
   published through the broker, and confirmed, before the delivery is settled.

Settling goes through the one settle path of every transport (``consumer_idem.transports.settle``):
publish durably, then ack; never ack a retry or an unconfirmed publish.

A delivery that cannot be settled yet (in progress elsewhere, a retryable failure, the store
down, the result publish failed after the commit) is delivered again after a backoff: on Kafka
the consumer seeks back to it (which holds back the subscriber, keeping partition order). On
RabbitMQ, waiting (store down, key in progress elsewhere) happens in hand, re-processing the
delivery, for up to ``max_hold`` seconds, and is then handed back as a copy at the tail of the
queue: neither spends the delivery budget. A handler failure worth retrying is
``nack(requeue=True)``-ed, which does. The budget (``max_deliveries``) counts the attempts that
ran the key's handler, in Postgres, as ``RabbitRunner``'s does (``faststream.budget``).

Kafka subscribers must keep the records of one partition in order: a subscriber with
``max_workers > 1`` that runs records of one partition side by side (FastStream's concurrent
subscriber with automatic commits, or any FastStream before 0.5.34) is refused with
:class:`IdempotencyConfigError`; FastStream's ``max_workers`` with ``AckPolicy.MANUAL`` (one
consumer per worker, each partition on one of them) is accepted.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import faststream  # noqa: F401 - the faststream extra
except ImportError as exc:
    raise missing("faststream", exc, __name__) from exc

import asyncio
import base64
import copy
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Annotated, Any, Protocol, Unpack

import asyncpg
from faststream import BaseMiddleware, Context, Response, StreamMessage
from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.message import AckStatus

from consumer_idem.consumer import (
    Action,
    IdempotentConsumer,
    Verdict,
    reconcile_notice,
)
from consumer_idem.errors import (
    IdempotencyConfigError,
    PoisonMessage,
)
from consumer_idem.execution import Attempt
from consumer_idem.faststream import batch, startup
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.faststream.budget import RabbitBudget
from consumer_idem.faststream.relay import OutboxRelayTask, faststream_route
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER, Notice
from consumer_idem.options import ConsumerArgs, ConsumerOptions, Mode
from consumer_idem.outbox import (
    OutgoingMessage,
    UnitOutbox,
    attach_dispatcher,
    outbox_for,
    send_all,
)
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle
from consumer_idem.transports.settle import RunnerStats
from consumer_idem.types import OutcomeKind, ResultKind

log = logging.getLogger("consumer_idem.faststream")

DEFAULT_RECONCILE_DESTINATION = "consumer_idem.reconcile"
#: the context name under which the handler finds :class:`IdempotencyContext`
CONTEXT_NAME = "idempotency"


@dataclass(frozen=True, slots=True)
class IdempotencyContext:
    """What an idempotent handler can inject (``Context("idempotency")``)."""

    scope: str
    key: str
    #: the transport-neutral view of the raw delivery (headers as bytes, coordinates)
    message: ConsumerMessage
    #: transactional mode: the open connection; write on it to commit with the record
    conn: asyncpg.Connection | None = None
    #: two-phase mode: the attempt (``attempt.downstream_key`` for the far side)
    attempt: Attempt | None = None
    #: transactional mode: the unit's outbox (what is published there commits with it)
    outbox: UnitOutbox | None = None


#: the open transaction's connection, for a handler parameter: ``conn: IdempotentConnection``
IdempotentConnection = Annotated[asyncpg.Connection, Context(f"{CONTEXT_NAME}.conn")]
#: the two-phase attempt, for a handler parameter: ``attempt: IdempotentAttempt``
IdempotentAttempt = Annotated[Attempt, Context(f"{CONTEXT_NAME}.attempt")]
#: the unit's outbox (transactional mode), for a handler parameter: ``outbox: IdempotentOutbox``;
#: its messages go out through the broker right after the commit
IdempotentOutbox = Annotated[UnitOutbox, Context(f"{CONTEXT_NAME}.outbox")]
#: scope, key, raw message and connection or attempt together
CurrentIdempotency = Annotated[IdempotencyContext, Context(CONTEXT_NAME)]


class _Settled(Exception):
    """Raised from the handler call so that FastStream publishes nothing for this delivery
    (dead letter, retry, unknown, domain error, any batch); the middleware swallows it after
    settling."""

    def __init__(self, verdict: Verdict | None) -> None:
        what = "batch" if verdict is None else f"{verdict.action} ({verdict.reason})"
        super().__init__(f"consumer-idem: {what}")
        self.verdict = verdict


@dataclass(frozen=True, slots=True)
class _Call:
    call_next: Callable[[StreamMessage[Any]], Awaitable[Any]]
    message: StreamMessage[Any]
    context: Any
    key: str
    #: a batch: the handler's copy of the whole delivery, decoded while its claim was in flight
    ahead: batch.DecodedAhead | None = None


_CURRENT: ContextVar[_Call] = ContextVar("consumer_idem_faststream_call")


# --- results -------------------------------------------------------------------------------------


def _store_form(result: Any) -> dict[str, Any]:
    """How a handler's return value is stored: an envelope, so that bytes and plain-Response
    headers survive. The first run publishes this form too, so a replay publishes the same."""
    if isinstance(result, Response):
        if type(result) is not Response:
            raise PoisonMessage(
                "result_not_replayable",
                f"{type(result).__name__} carries broker-specific fields a replay cannot "
                "reproduce; return the body, or a plain faststream.Response(body, headers=...)",
            )
        form = _store_form(result.body)
        form["headers"] = {str(k): str(v) for k, v in result.headers.items()}
        return form
    if isinstance(result, bytes | bytearray | memoryview):
        return {"body_b64": base64.b64encode(bytes(result)).decode()}
    return {"body": _jsonable(result)}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    try:  # pydantic models, dataclasses, datetimes, UUIDs... (pydantic comes with FastStream)
        from pydantic_core import to_jsonable_python
    except ImportError:  # pragma: no cover - FastStream without pydantic
        return value
    return to_jsonable_python(value)


#: stored for a handler that raised FastStream's AckMessage: acked, nothing published
_ACK_ONLY = {"ack_only": True}
_NOTHING = object()


def _published_form(stored: Any) -> Any:
    """What FastStream publishes for a stored result (first run and replays alike)."""
    if stored == _ACK_ONLY:
        return _NOTHING
    if not isinstance(stored, dict):
        return stored  # a result stored by something else than this middleware
    if "body_b64" in stored:
        body: Any = base64.b64decode(stored["body_b64"])
    else:
        body = stored.get("body")
    if "headers" in stored:
        return Response(body, headers=dict(stored["headers"]))
    return body


# --- transports ----------------------------------------------------------------------------------


class _Transport(Protocol):
    """What differs between the brokers; :class:`_Settler` turns it into the settle path's
    transport."""

    #: waits happen in hand (RabbitMQ: a hand-back would spend the delivery budget)
    holds_waits: bool

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage: ...

    def check(self, subscriber: Any) -> None: ...

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str: ...

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        """The broker properties a notice carries for a re-dispatch (AMQP's; None for Kafka,
        whose record key and coordinates are in ``incoming``)."""
        ...

    def permanent(self, exc: BaseException) -> bool: ...

    async def ack(self, message: StreamMessage[Any]) -> None: ...

    async def retry(self, message: StreamMessage[Any]) -> None: ...

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        """Publish a copy of ``message`` at the tail of ``source`` (waits held too long)."""
        ...

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None: ...

    async def notice(self, scope: str, key: str, body: bytes) -> None: ...

    async def redispatch(self, notice: Notice) -> None: ...


class _Kafka:
    holds_waits = False  # a seek back costs nothing; holding would exceed max.poll.interval

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

        self.idem = idem
        self.broker = broker
        self._consumer_type = AIOKafkaConsumer
        self._tp = TopicPartition
        self._commit_errors = (CommitFailedError, IllegalStateError, KafkaError, AssertionError)
        # batch subscribers' background commits, per consumer: the offsets still to commit
        # and the task committing them
        self._uncommitted: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], int]] = (
            weakref.WeakKeyDictionary()
        )
        self._committers: weakref.WeakKeyDictionary[Any, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )
        options = getattr(broker, "_connection_kwargs", {})  # FastStream keeps them here
        if options.get("acks") not in ("all", -1) and not options.get("enable_idempotence"):
            log.warning(
                "KafkaBroker without acks='all': a dead letter or reconciliation notice may be "
                "lost with a broker failover after its delivery was committed. "
                "Create it with KafkaBroker(..., acks='all', enable_idempotence=True)."
            )

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        from consumer_idem.transports.kafka import to_message

        record = message.raw_message
        if not hasattr(record, "offset"):  # (a batch's tuple goes through members())
            raise IdempotencyConfigError("a Kafka Idempotency middleware got a non-Kafka message")
        return to_message(record)

    def check(self, subscriber: Any) -> None:
        # FastStream's max_workers with manual commits runs one consumer per worker (each
        # partition in order on one of them: it has ``consumer_subgroup``); any other
        # concurrency runs records of one partition side by side, and committing offset + 1 of
        # a finished record would commit past an earlier one still running.
        workers = getattr(subscriber, "max_workers", 1) or 1
        if workers > 1 and not hasattr(subscriber, "consumer_subgroup"):
            raise IdempotencyConfigError(
                f"this Kafka subscriber runs max_workers={workers} records of one partition "
                "at once, so a commit could pass a record still running: use max_workers=1, "
                "or FastStream >= 0.5.34 with ack_policy=AckPolicy.MANUAL (concurrent between "
                "partitions only)"
            )

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        return str(message.raw_message.topic)

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        return None

    def permanent(self, exc: BaseException) -> bool:
        from consumer_idem.transports.kafka import PERMANENT_ERRORS

        return isinstance(exc, PERMANENT_ERRORS)

    async def ack(self, message: StreamMessage[Any]) -> None:
        record = message.raw_message
        # This partition only, up to this record: FastStream's own ack commits every
        # partition's position, which may be ahead of what is done.
        offsets = {(record.topic, record.partition): record.offset + 1}
        await self.commit(getattr(message, "consumer", None), offsets)
        message.committed = AckStatus.ACKED

    async def commit(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``{(topic, partition): next offset}`` through the delivery's consumer."""
        if isinstance(consumer, self._consumer_type):
            try:
                await consumer.commit({self._tp(*tp): offset for tp, offset in offsets.items()})
            except self._commit_errors as exc:
                # Rebalancing, or no longer ours: the next owner re-reads from the last commit
                # and meets completed records (replays), so nothing is lost or doubled.
                log.warning("commit of %s failed: %r", offsets, exc)
        elif consumer is not None and offsets:  # FastStream's test consumer: nothing to commit
            await consumer.commit()

    def commit_soon(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> None:
        """Commit in the background, the latest offsets first come: the subscriber fetches and
        runs its next batch instead of waiting for the broker (a few ms per commit). A commit
        that lags, or is lost when the consumer stops, only widens what is delivered again,
        and the keys make those replays (as ``KafkaRunner``'s background commits)."""
        if consumer is None or not offsets:
            return
        uncommitted = self._uncommitted.setdefault(consumer, {})
        for tp, offset in offsets.items():
            uncommitted[tp] = max(offset, uncommitted.get(tp, 0))
        running = self._committers.get(consumer)
        if running is None or running.done():
            task = asyncio.create_task(self._commit_latest(consumer))
            task.add_done_callback(_log_failure)
            self._committers[consumer] = task

    async def _commit_latest(self, consumer: Any) -> None:
        while offsets := self._uncommitted.pop(consumer, None):
            await self.commit(consumer, offsets)

    def seek(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> None:
        """Deliver each partition again from ``offsets[(topic, partition)]``."""
        if consumer is None:
            return
        for tp, offset in offsets.items():
            try:
                consumer.seek(self._tp(*tp), offset)
            except self._commit_errors as exc:  # revoked meanwhile: its next owner re-reads it
                log.warning("seek of %s/%s to %s failed: %r", *tp, offset, exc)

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

        await self._publish(
            to,
            b"" if body_dropped else record.value,
            record.key,
            dead_letter_headers(record, verdict, body_dropped),
            correlation_id,
        )

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self._publish(
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
        await self._publish(
            notice.source, notice.body, notice.record_key, redispatch_headers(notice)
        )

    async def _publish(
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


class _Rabbit:
    holds_waits = True

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        self.idem = idem
        self.broker = broker
        self._declared: set[str] = set()

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        from consumer_idem.transports.rabbit import to_message

        raw = message.raw_message
        if not hasattr(raw, "delivery_tag"):
            raise IdempotencyConfigError("a RabbitMQ Idempotency middleware got a non-AMQP message")
        return to_message(raw)

    def check(self, subscriber: Any) -> None:
        """Deliveries are acked one by one: any concurrency is fine. The queue's own delivery
        limit must not end a message before the budget does."""
        assert self.idem.budget is not None
        self.idem.budget.check_queue(subscriber)

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        queue = getattr(subscriber, "queue", None)
        name = getattr(queue, "name", None)
        return str(name or message.raw_message.routing_key)

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        from consumer_idem.transports.rabbit import amqp_properties

        return None if incoming.raw is None else amqp_properties(incoming.raw)

    def permanent(self, exc: BaseException) -> bool:
        from consumer_idem.transports.rabbit import permanent

        return permanent(exc)

    async def ack(self, message: StreamMessage[Any]) -> None:
        await message.ack()

    async def retry(self, message: StreamMessage[Any]) -> None:
        await message.nack(requeue=True)  # type: ignore[call-arg]

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        """Publish a copy to hand the delivery back without spending its delivery budget: at
        the tail of the queue, carrying the deliveries already spent (the caller then acks the
        original)."""
        from consumer_idem.transports.rabbit import handed_back_copy, spent_deliveries

        raw = message.raw_message
        copy = handed_back_copy(raw, spent_deliveries(self.incoming(message)))
        await self._send(
            source,
            copy.body,
            dict(copy.headers),
            message_id=copy.message_id,
            correlation_id=copy.correlation_id,
            content_type=copy.content_type,
        )

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None:
        from consumer_idem.transports.rabbit import dead_letter_headers

        raw = message.raw_message
        await self._publish(
            to,
            b"" if body_dropped else raw.body,
            dead_letter_headers(raw, verdict, source, body_dropped),
            message_id=raw.message_id,
            correlation_id=raw.correlation_id,
            content_type=raw.content_type,
        )

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self._publish(
            self.idem.reconcile_destination,
            body,
            {SCOPE_HEADER: scope, KEY_HEADER: key},
            content_type="application/json",
        )

    async def redispatch(self, notice: Notice) -> None:
        """The original as it was: body, headers and properties (``message_id``,
        ``correlation_id``, ``content_type``, ``type``...; FastStream's publish has no
        ``app_id``), as ``RabbitRunner`` re-dispatches it."""
        from consumer_idem.transports.rabbit import redispatch_headers, redispatch_properties

        assert notice.source is not None and notice.body is not None
        properties = redispatch_properties(notice)
        properties.pop("app_id", None)
        if "type" in properties:
            properties["message_type"] = properties.pop("type")
        await self._publish(notice.source, notice.body, redispatch_headers(notice), **properties)

    async def _publish(
        self, queue: str, body: bytes, headers: dict[str, Any], **properties: Any
    ) -> None:
        if self.idem.declare and queue not in self._declared:
            from faststream.rabbit import QueueType, RabbitQueue

            # the same declaration as RabbitRunner's: durable quorum queues
            await self.broker.declare_queue(RabbitQueue(queue, queue_type=QueueType.QUORUM))
            self._declared.add(queue)
        await self._send(queue, body, headers, **properties)

    async def _send(
        self, queue: str, body: bytes, headers: dict[str, Any], **properties: Any
    ) -> None:
        import aiormq

        # persistent, mandatory, awaited publisher confirm (FastStream's default channel)
        result = await self.broker.publish(
            body, queue, headers=headers, persist=True, mandatory=True, **properties
        )
        if isinstance(result, aiormq.abc.DeliveredMessage):  # returned: no queue took it
            raise aiormq.exceptions.PublishError(result, result.delivery)


# --- the middleware ------------------------------------------------------------------------------


class Idempotency:
    """A FastStream middleware factory making subscribers idempotent (see the module docstring).

    ``store``: a :class:`PostgresStore`, or a callable returning it (for apps that open their
    pool on startup). ``broker``: the ``KafkaBroker`` or ``RabbitBroker`` the subscribers belong
    to; dead letters, reconciliation notices and re-dispatches are published through it.
    The other arguments are those of :func:`consumer_idem.idempotent_consumer`, plus:

    * ``dead_letter``: destination for poison messages: a name, or a callable of the source
      topic/queue (default ``<source>.dlq``);
    * ``reconcile_destination``: topic or queue for notices of ``unknown`` outcomes;
    * ``max_deliveries`` (RabbitMQ): a key whose handler ran this many times without settling
      (it keeps failing, or killing the consumer) is dead-lettered without running again;
      only the key's own runs count, not the broker's returns, and a key whose record says it
      completed is acked, never dead-lettered (:mod:`consumer_idem.faststream.budget`);
    * ``declare`` (RabbitMQ): declare the dead-letter and notice queues (durable, quorum);
    * ``max_hold`` (RabbitMQ): how long a delivery waiting for the store or for another owner
      stays in hand before it is handed back as a copy (keep it under ``consumer_timeout``).

    It also serves as the transport of a :class:`~consumer_idem.operations.reconcile.Sweeper` or
    :class:`~consumer_idem.operations.reconcile.Reconciler` (``publish_notice``, ``redispatch``),
    and as the sender of the outbox (``send_batch``): what a handler publishes through
    :data:`IdempotentOutbox` goes out through ``broker`` right after the commit, and a relay
    sends what a crash or an outage left behind (``idem.outbox_relay``, see
    :mod:`consumer_idem.faststream.relay`):

    * ``outbox_relay``: seconds between the relay's passes (None: run no relay here);
    * ``app``: the ``FastStream`` app: the relay starts once it has started its broker and
      stops before it stops it (without it: at the first delivery, and with the broker).
    """

    def __init__(
        self,
        store: PostgresStore | Callable[[], PostgresStore],
        *,
        broker: Any,
        scope: str,
        mode: Mode = "transactional",
        dead_letter: str | Callable[[str], str] | None = None,
        reconcile_destination: str = DEFAULT_RECONCILE_DESTINATION,
        max_deliveries: int | None = 20,
        declare: bool = True,
        max_hold: float | None = 600.0,
        outbox_relay: float | None = 5.0,
        app: Any = None,
        **options: Unpack[ConsumerArgs],
    ) -> None:
        self._store_source = store
        self.options = ConsumerOptions(scope=scope, mode=mode, **options)
        self.scope = scope
        self._consumer: IdempotentConsumer | None = None
        if isinstance(store, PostgresStore):
            self._consumer = self._build(store)
        elif not callable(store):  # fail here, not on the first message
            raise TypeError("store must be a PostgresStore or a callable returning one")
        self.broker = broker
        self.dead_letter = dead_letter
        self.reconcile_destination = reconcile_destination
        self.max_deliveries = max_deliveries
        self.declare = declare
        self.max_hold = max_hold
        self.stats = RunnerStats()
        self.transport = self._transport_for(broker)
        #: the outbox sender's route: the broker's transport and cluster (see .relay)
        self.route = faststream_route(
            broker, "kafka" if isinstance(self.transport, _Kafka) else "amqp"
        )
        #: the relay of what a crash or an outage left in the outbox (see .relay)
        self.outbox_relay = OutboxRelayTask(self, outbox_relay, app)
        #: RabbitMQ's delivery budget, counted per key in Postgres
        self.budget = RabbitBudget(self) if isinstance(self.transport, _Rabbit) else None
        self._batch_consumer: IdempotentConsumer | None = None
        startup.guard_start(self, broker)  # unsafe subscribers refused before any fetch

    def _build(self, store: PostgresStore) -> IdempotentConsumer:
        attach_dispatcher(store, self, [self.scope])  # the outbox goes out through the broker
        return IdempotentConsumer(self._handle, store=store, options=self.options)

    def _transport_for(self, broker: Any) -> _Transport:
        kinds: list[tuple[str, str, type[_Kafka] | type[_Rabbit]]] = [
            ("faststream.kafka", "KafkaBroker", _Kafka),
            ("faststream.rabbit", "RabbitBroker", _Rabbit),
        ]
        for module, name, transport in kinds:
            try:
                broker_type = getattr(__import__(module, fromlist=[name]), name)
            except ImportError:
                continue
            if isinstance(broker, broker_type):
                return transport(self, broker)
        raise IdempotencyConfigError(
            f"broker must be a FastStream KafkaBroker or RabbitBroker, not {type(broker).__name__}"
        )

    # --- configuration the transports read -----------------------------------------------------

    @property
    def consumer(self) -> IdempotentConsumer:
        """The core :class:`IdempotentConsumer` (built on first use when ``store`` is a
        callable)."""
        if self._consumer is None:
            store = self._store_source
            assert not isinstance(store, PostgresStore)
            self._consumer = self._build(store())
        return self._consumer

    @property
    def batch_consumer(self) -> IdempotentConsumer:
        """The core consumer of Kafka batch subscribers: the same options in batch mode (see
        :mod:`consumer_idem.faststream.batch`)."""
        if self._batch_consumer is None:
            if self.options.mode != "transactional":
                raise IdempotencyConfigError(
                    "a batch subscriber commits its batch in one transaction: transactional "
                    "mode only (two-phase runs external I/O per message: subscribe without "
                    "batch=True)"
                )
            self._batch_consumer = IdempotentConsumer(
                self._handle_batch, store=self.store, options=replace(self.options, batch=True)
            )
        return self._batch_consumer

    @property
    def store(self) -> PostgresStore:
        return self.consumer.store

    def dead_letter_destination(self, source: str) -> str:
        if self.dead_letter is None:
            return f"{source}.dlq"
        return self.dead_letter(source) if callable(self.dead_letter) else self.dead_letter

    # --- FastStream's middleware protocol ------------------------------------------------------

    def __call__(self, msg: Any, /, *, context: Any) -> _Middleware:
        return _Middleware(msg, context=context, idem=self)

    # --- the handler the core runs -------------------------------------------------------------

    async def _handle(self, message: ConsumerMessage, arg: Any) -> Any:
        call = _CURRENT.get()
        attempt = arg if isinstance(arg, Attempt) else None
        conn = None if attempt is not None else arg
        ctx = IdempotencyContext(
            scope=self.scope,
            key=call.key,
            message=message,
            conn=conn,
            attempt=attempt,
            outbox=None if conn is None else outbox_for(conn),
        )
        result = await _call(call, ctx, guarded(call.message))
        return dict(_ACK_ONLY) if result is _ACKED else _store_form(result)

    async def _handle_batch(self, messages: Sequence[ConsumerMessage], conn: Any) -> list[Any]:
        return await batch.handle(self, _CURRENT.get(), messages, conn)

    # --- publishing, also for Sweeper / Reconciler (consumer_idem.transports.settle.Publisher) ----

    async def publish_notice(
        self, scope: str, key: str, body: bytes, *, subscriber: Any = None
    ) -> bool:
        """Publish a reconciliation notice (confirmed) and record that it was published."""
        return await settle.publish_notice(_Settler(self, subscriber), scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        """Send the original message of a notice back to where it came from, to run once."""
        return await settle.redispatch(_Settler(self), notice)

    # --- the outbox's sender (consumer_idem.outbox.OutboxSender) -------------------------------

    def permanent(self, exc: BaseException) -> bool:
        return self.transport.permanent(exc)

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        """Publish outgoing messages of the outbox through the broker, each confirmed."""
        return await send_all(self._send_outgoing, messages, self.permanent)

    async def _send_outgoing(self, message: OutgoingMessage) -> None:
        transport = self.transport
        if isinstance(transport, _Kafka):
            await transport._publish(
                message.destination, message.body, message.key, message.headers
            )
            return
        assert isinstance(transport, _Rabbit)
        from consumer_idem.transports.rabbit import outgoing_message

        amqp = outgoing_message(message)
        await transport._publish(
            message.destination,
            message.body,
            dict(amqp.headers),
            message_id=amqp.message_id,
            content_type=amqp.content_type,
        )


class _Settler(batch.SubscriberSide):
    """The settle path's transport (``consumer_idem.transports.settle.Transport``) for one
    subscriber: a subscriber that is shutting down stops retrying publishes."""

    def __init__(
        self,
        idem: Idempotency,
        subscriber: Any = None,
        incoming: ConsumerMessage | None = None,
        source: str = "",
    ) -> None:
        self.idem = idem
        self.subscriber = subscriber
        self.incoming = incoming
        self.source = source
        self.stats = idem.stats
        self.transport = idem.transport

    async def ack(self, message: StreamMessage[Any]) -> None:
        await self.transport.ack(message)

    async def retry_later(self, message: StreamMessage[Any], verdict: Verdict) -> None:
        if self.idem.budget is not None:
            await self.idem.budget.failed(message, verdict)
        # a wait held for max_hold already: hand it back without spending the delivery budget
        if (
            self.transport.holds_waits
            and settle.is_wait(verdict)
            and not self.stopping()
            and await settle.publish_until_sent(
                lambda: self.transport.requeue(message, self.source),
                destination=self.source,
                stopping=self.stopping,
                permanent=self.permanent,
            )
        ):
            await self.transport.ack(message)  # the copy is in the queue: drop the original
            return
        log.info("retrying in %.2fs (%s)", verdict.retry_after, verdict.reason)
        await settle.pause(verdict.retry_after, self.stopping)
        await self.give_back(message)

    async def give_back(self, message: StreamMessage[Any]) -> None:
        try:
            await self.transport.retry(message)
        except Exception as exc:  # e.g. the partition was revoked meanwhile: its next owner
            log.warning("could not hand the delivery back: %r", exc)  # re-reads it anyway

    def dead_letter_destination(self, message: StreamMessage[Any]) -> str:
        return self.idem.dead_letter_destination(self.source)

    def body_size(self, message: StreamMessage[Any]) -> int:
        return len(self.incoming.body) if self.incoming is not None else 0

    async def send_dead_letter(
        self, message: StreamMessage[Any], verdict: Verdict, body_dropped: bool
    ) -> None:
        await self.transport.dead_letter(
            message, verdict, self.source, self.dead_letter_destination(message), body_dropped
        )

    def notice_body(
        self, message: StreamMessage[Any], verdict: Verdict, with_original: bool
    ) -> bytes:
        if not with_original or self.incoming is None:
            return reconcile_notice(verdict)
        return reconcile_notice(
            verdict, self.incoming, self.source, self.transport.properties(self.incoming)
        )

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self.transport.notice(scope, key, body)

    async def send_redispatch(self, notice: Notice) -> None:
        await self.transport.redispatch(notice)


#: what :func:`_call` answers for a handler that raised FastStream's AckMessage
_ACKED = object()


def guarded(message: StreamMessage[Any]) -> StreamMessage[Any]:
    """The delivery as the handler sees it (its ``message`` too): a copy whose ``ack()``,
    ``nack()`` and ``reject()`` do nothing. The middleware settles the delivery after the
    commit; a handler's own ack would commit the Kafka offset (of every partition, for
    FastStream) or ack the AMQP delivery before it, and a crash then would lose the message.
    The copy also decodes its body afresh (its decoded cache is its own)."""
    handed = copy.copy(message)
    handed.committed = AckStatus.ACKED
    return handed


async def _call(call: _Call, current: Any, message: StreamMessage[Any]) -> Any:
    """FastStream's handler call on ``message`` (injected as ``message`` as well), with
    ``current`` as the idempotency context; its own exceptions turned into the core's."""
    try:
        with call.context.scopes(((CONTEXT_NAME, current), ("message", message))):
            return await call.call_next(message)
    except AckMessage:  # "done, ack it": what was written so far commits, unpublished
        return _ACKED
    except NackMessage as exc:  # "deliver it again": roll back, retry with backoff
        raise RuntimeError("the handler asked for redelivery (NackMessage)") from exc
    except RejectMessage as exc:
        raise PoisonMessage("rejected", "the handler rejected the message") from exc
    except _validation_errors() as exc:  # the body does not fit the handler's types
        raise PoisonMessage("invalid_payload", str(exc)[:500]) from exc


@functools.cache  # once: it runs on every handler call
def _validation_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    try:
        from fast_depends.exceptions import ValidationError as DependsValidationError

        errors.append(DependsValidationError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from pydantic import ValidationError

        errors.append(ValidationError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


class _Middleware(BaseMiddleware):
    """One delivery through :class:`Idempotency`."""

    def __init__(self, msg: Any, /, *, context: Any, idem: Idempotency) -> None:
        super().__init__(msg, context=context)
        self.idem = idem
        self.message: StreamMessage[Any] | None = None
        self.subscriber: Any = None
        self.incoming: ConsumerMessage | None = None
        self.verdict: Verdict | None = None
        #: a batch subscriber's delivery: its records and their verdicts (in order, up to the
        #: first that must wait)
        self.members: list[ConsumerMessage] | None = None
        self.verdicts: list[Verdict] | None = None

    async def consume_scope(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        idem = self.idem
        self.subscriber = self.context.get("handler_")
        idem.transport.check(self.subscriber)
        unsafe = startup.unsafe_ack_policy(self.subscriber)  # a test broker skips start()
        if unsafe is not None:
            raise IdempotencyConfigError(unsafe)
        if msg.committed is not None:
            raise IdempotencyConfigError(
                "the delivery was acknowledged before the handler ran (AckPolicy.ACK_FIRST, "
                "FastStream's default on Kafka, auto-commits): subscribe with "
                "ack_policy=AckPolicy.MANUAL"
            )
        self.message = msg
        await idem.outbox_relay.first_delivery()
        if isinstance(msg.raw_message, tuple | list):  # a Kafka batch subscriber (a list: tests)
            self.members = batch.members(idem, self.subscriber, msg)
            ahead = None
            if batch.innermost(self.subscriber, call_next):
                ahead = batch.DecodedAhead(msg, self.members, self.context)
            token = _CURRENT.set(_Call(call_next, msg, self.context, "", ahead))
            try:
                self.verdicts = await idem.batch_consumer.process_batch(
                    self.members, alongside=ahead
                )
            finally:
                _CURRENT.reset(token)
            raise _Settled(None)  # a batch subscriber publishes nothing through FastStream
        self.incoming = idem.transport.incoming(msg)
        if idem.transport.holds_waits:
            process: Callable[[], Awaitable[Verdict]]
            process = functools.partial(self._run, call_next, msg)
            if idem.budget is not None:
                process = idem.budget.processing(
                    msg,
                    functools.partial(idem.transport.incoming, msg),
                    functools.partial(self._execute, call_next, msg),
                    process,
                )
            stopping = _Settler(idem, self.subscriber).stopping
            verdict = await settle.process_holding(
                process, stats=idem.stats, stopping=stopping, max_hold=idem.max_hold
            )
        else:
            verdict = await self._run(call_next, msg)
        self.verdict = verdict
        outcome = verdict.outcome
        if (
            verdict.action is Action.ACK
            and not verdict.reconcile
            and outcome is not None
            and outcome.kind in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED)
            and outcome.result_kind is ResultKind.SUCCESS
        ):
            published = _published_form(verdict.result)
            if published is not _NOTHING:
                return published
        raise _Settled(verdict)

    async def _run(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Verdict:
        consumer = self.idem.consumer
        # a fresh view per attempt: a handler that changed the parsed body in place must not
        # hand its changes to the next attempt
        incoming = self.idem.transport.incoming(msg)
        prepared = consumer.prepare(incoming)
        if isinstance(prepared, Verdict):
            return prepared
        return await self._execute(call_next, msg, incoming, *prepared)

    async def _execute(
        self,
        call_next: Callable[[StreamMessage[Any]], Awaitable[Any]],
        msg: StreamMessage[Any],
        incoming: ConsumerMessage,
        key: str,
        fingerprint: str,
    ) -> Verdict:
        """The claim engine on a prepared delivery, FastStream's handler call at hand."""
        token = _CURRENT.set(_Call(call_next, msg, self.context, key))
        try:
            return await self.idem.consumer.execute(incoming, key, fingerprint)
        finally:
            _CURRENT.reset(token)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        message, verdict = self.message, self.verdict
        if isinstance(exc_val, IdempotencyConfigError | asyncio.CancelledError):
            return False  # never ours to settle (or shutting down: it is delivered again)
        if message is None:
            if self.context.get("message") is not None:
                return False  # routed, but a middleware outside this one did not call it
            # FastStream failed to parse or route it (its error may have been swallowed by
            # an exception middleware inside this one)
            return await self._unrouted(exc_val)
        decided = verdict is not None if self.members is None else self.verdicts is not None
        if not decided or (exc_val is not None and not isinstance(exc_val, _Settled)):
            # Failed before a verdict, or the result could not be published after the commit:
            # deliver it again (a batch: each partition from its first record); the redelivery
            # replays the stored result and publishes it.
            self.idem.stats.retries += 1
            log.warning("delivery not settled, will be delivered again: %r", exc_val)
            settler = _Settler(self.idem, self.subscriber)
            await settle.pause(self.idem.consumer.backoff_base, settler.stopping)
            await settler.give_back(message)
            return False
        if self.members is not None:
            assert self.verdicts is not None
            consumer = getattr(message, "consumer", None)
            done = await batch.settle_batch(
                self.idem, self.subscriber, consumer, self.members, self.verdicts
            )
            message.committed = AckStatus.ACKED if done else AckStatus.NACKED
        else:
            assert verdict is not None
            await settle.settle(self._settler(message), message, verdict)
        return exc_val is not None  # our own _Settled: swallowed

    async def _unrouted(self, exc: BaseException | None) -> bool:
        """A delivery FastStream could not parse or route (``consumer_idem.faststream.unrouted``):
        dead-letter what cannot run, run the rest; anything else is handed back."""
        from consumer_idem.faststream import unrouted

        self.subscriber = self.context.get("handler_")
        try:
            if await unrouted.settle_unrouted(self.idem, self.context, self.msg):
                return exc is not None  # FastStream's error: handled
        except Exception as failure:
            log.warning("could not settle a delivery FastStream refused: %r", failure)
        records = unrouted.kafka_records(self.idem, self.msg)
        if records:
            self.idem.stats.retries += 1
            log.warning("delivery not handed to the handler, will be delivered again: %r", exc)
            stopping = _Settler(self.idem, self.subscriber).stopping
            await settle.pause(self.idem.consumer.backoff_base, stopping)
            unrouted.seek_back(self.idem, self.subscriber, records)
        return False

    def _settler(self, message: StreamMessage[Any]) -> _Settler:
        source = self.idem.transport.source(message, self.subscriber)
        return _Settler(self.idem, self.subscriber, self.incoming, source)
