"""FastStream Kafka batch subscribers (``@subscriber(topic, batch=True)``) and NATS batch pull
subscribers (``pull_sub=PullSub(n, batch=True)``) through
[`Idempotency`][consumer_idem.faststream.Idempotency].

One delivered batch (the records of one ``getmany``, of one or more partitions) is one
transaction, as in ``KafkaRunner``'s batch mode, decided by the same core
(``IdempotentConsumer.process_batch``): every key is claimed at once; the handler gets the
bodies of the members to run (duplicates, within the batch or of earlier ones, and records
without a valid key never reach it); their effects, results and outgoing messages commit
together. If that transaction fails, the members run one transaction each (the handler gets a
list of one): a poison member is dead-lettered alone, a failing one waits alone, the others
commit.

Settling, in offset order per partition: a member's dead letter or reconciliation notice is
published (and confirmed) first; then one commit names, for each partition, the offset after its
last settled record. A partition whose record must wait (a retry, its key in progress elsewhere,
the store down, a publish not confirmed) is sought back to that record after the wait, so it and
the records after it are delivered again, and none before it.

A NATS batch is decided the same way and settled per message, in no order
(`consumer_idem.faststream.nats_batch`); so is a Redis stream batch, per entry
(`consumer_idem.faststream.redis_batch`).

A batch subscriber publishes nothing through FastStream: its return value would be one message
for the whole batch, which a redelivery of part of it could not reproduce. The middleware
refuses a batch subscriber with publishers; publish per member through the transactional
outbox (``current.outboxes[i]``), which commits with that member.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, cast, overload

import asyncpg
from faststream import Context, StreamMessage

from consumer_idem.consumer import Verdict, reconcile_notice, settled_by_commit
from consumer_idem.errors import IdempotencyConfigError, PoisonMessage
from consumer_idem.faststream import _compat
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice
from consumer_idem.outbox import UnitOutbox, outbox_for
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle

if TYPE_CHECKING:
    from consumer_idem.faststream.context import _Call
    from consumer_idem.faststream.idempotency import Idempotency
    from consumer_idem.faststream.kafka_side import _Kafka

log = logging.getLogger("consumer_idem.faststream")


@dataclass(frozen=True, slots=True)
class IdempotencyBatchContext:
    """What a batch handler can inject (``current: CurrentIdempotencyBatch``): one entry per
    body the handler was given, in the same order."""

    scope: str
    keys: list[str]
    #: the transport-neutral view of each record (headers as bytes, coordinates)
    messages: list[ConsumerMessage]
    #: the open connection: write on it to commit with the records
    conn: asyncpg.Connection
    #: each member's outbox: what is published there commits with that member
    outboxes: Sequence[UnitOutbox]


class _Outboxes(Sequence[UnitOutbox]):
    """``current.outboxes``: member ``i``'s outbox is made when the handler first asks for it
    (most members of a big batch publish nothing)."""

    def __init__(self, conn: Any, messages: Sequence[ConsumerMessage]) -> None:
        self._conn = conn
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, index: int) -> UnitOutbox: ...
    @overload
    def __getitem__(self, index: slice) -> list[UnitOutbox]: ...
    def __getitem__(self, index: int | slice) -> UnitOutbox | list[UnitOutbox]:
        if isinstance(index, slice):
            return [outbox_for(self._conn, m) for m in self._messages[index]]
        return outbox_for(self._conn, self._messages[index])


#: the batch's context, for a handler parameter: ``current: CurrentIdempotencyBatch``
CurrentIdempotencyBatch = Annotated[IdempotencyBatchContext, Context("idempotency")]


def is_batch(message: StreamMessage[Any]) -> bool:
    """Is ``message`` a batch subscriber's delivery (Kafka, NATS: a tuple or list of records;
    Redis: a ``bstream`` entry list)? Read here, not in `redis_batch`: importing that imports
    the Redis client, a second's work on the first delivery of any other broker."""
    raw = message.raw_message
    return isinstance(raw, tuple | list) or (isinstance(raw, dict) and raw.get("type") == "bstream")


async def members(
    idem: Idempotency, subscriber: Any, message: StreamMessage[Any]
) -> list[ConsumerMessage]:
    """The records of a batch delivery, after checking that the subscriber can run them."""
    from consumer_idem.faststream.kafka_side import _Kafka
    from consumer_idem.faststream.nats_side import _Nats
    from consumer_idem.faststream.redis_side import _Redis

    transport = idem.transport
    if not isinstance(transport, _Kafka | _Nats | _Redis):
        raise IdempotencyConfigError(
            "only Kafka, NATS JetStream and Redis streams deliver batches to a FastStream "
            "subscriber"
        )
    for call in _compat.handler_calls(subscriber):
        if _compat.has_publishers(call):
            raise IdempotencyConfigError(
                "a batch subscriber's return value is one message for the whole batch, which "
                "a redelivery of part of it could not reproduce: drop its publishers and "
                "publish per member through current.outboxes[i] (CurrentIdempotencyBatch)"
            )
    idem.batch_consumer  # noqa: B018 - refuses two-phase mode here, before anything runs
    if isinstance(transport, _Nats):
        return [transport.incoming_raw(raw) for raw in message.raw_message]
    if isinstance(transport, _Redis):
        from consumer_idem.faststream import redis_batch

        return await redis_batch.members(transport, subscriber, message)
    return [transport.message_of(record) for record in message.raw_message]


async def handle(
    idem: Idempotency, call: _Call, messages: Sequence[ConsumerMessage], conn: Any
) -> list[Any]:
    """The core's batch handler: FastStream's handler over ``messages`` (all of the delivery,
    or the part the core runs), one stored result per message."""
    from consumer_idem.faststream.handler_call import _ACKED, _call
    from consumer_idem.faststream.results import _store_form

    consumer = idem.batch_consumer
    keys = []
    for message in messages:
        prepared = consumer.prepare(message)  # memoized: the core derived it already
        assert not isinstance(prepared, Verdict), "a member without a key reached the handler"
        keys.append(prepared[0])
    # the outboxes keep their own order: a handler may reorder ``current.messages`` in place
    outboxes = _Outboxes(conn, tuple(messages))
    current = IdempotencyBatchContext(idem.scope, keys, list(messages), conn, outboxes)
    handed = call.ahead.take(messages) if call.ahead is not None else None
    if handed is None:
        handed = _narrowed(call.message, messages)
    result = await _call(call, current, handed)
    if result is None or result is _ACKED:  # nothing to store: a batch publishes nothing
        return []
    if not isinstance(result, list | tuple) or len(result) != len(messages):
        got = f"{len(result)} results" if isinstance(result, list | tuple) else repr(result)[:80]
        raise PoisonMessage(
            "batch_result",
            f"a batch handler returns None or one result per body: {got} for {len(messages)}",
        )
    return [None if r is None else _store_form(r) for r in result]


def _narrowed(message: StreamMessage[Any], run: Sequence[ConsumerMessage]) -> StreamMessage[Any]:
    """The delivery as FastStream would have made it of the records in ``run`` only (its
    decoder reads ``raw_message``), guarded as the per-message handler's delivery is."""
    from consumer_idem.faststream.handler_call import guarded

    if isinstance(message.raw_message, dict):  # a Redis stream batch
        from consumer_idem.faststream import redis_batch

        return redis_batch.narrowed(message, run)
    position = {id(record): i for i, record in enumerate(message.raw_message)}
    picked = [position[id(m.raw)] for m in run]
    narrowed = guarded(message)
    narrowed.raw_message = tuple(message.raw_message[i] for i in picked)
    narrowed.body = [message.body[i] for i in picked]
    if message.batch_headers:
        narrowed.batch_headers = [message.batch_headers[i] for i in picked]
        narrowed.headers = narrowed.batch_headers[0] if picked else {}
    return narrowed


def innermost(subscriber: Any, call_next: Any) -> bool:
    """Is ``call_next`` the handler's own call, with no middleware inside this one? Only then
    does nothing run between this middleware and the handler's decode: a middleware inside it
    may change what the decoder reads (the records in place, a header, a context variable)."""
    return _compat.is_handler_call(subscriber, call_next)


class DecodedAhead:
    """The handler's copy of the whole delivery, decoded (by the subscriber's decoder, cached
    in the copy as FastStream caches a decode) while the batch's claim is in flight: the decode
    is most of the handler call's own cost, and the process would otherwise wait idle for
    Postgres. Used only when this middleware is the innermost
    ([`innermost`][consumer_idem.faststream.batch.innermost]), and taken
    only when the core runs every record, in order (no duplicate, no fallback); otherwise the
    handler's copy is narrowed and decoded afresh, and this one is dropped. A decoder should
    have no side effects: it may run once more, or for a batch whose records were all done
    already. It runs with ``message`` in the context (the copy), as in the handler's call, but
    before the ``idempotency`` context exists."""

    def __init__(
        self, message: StreamMessage[Any], members: Sequence[ConsumerMessage], context: Any
    ) -> None:
        self.message = message
        self.members = members
        self.context = context
        self.copy: StreamMessage[Any] | None = None

    async def __call__(self) -> None:
        copy = _narrowed(self.message, self.members)
        with self.context.scopes((("message", copy),)):
            await copy.decode()  # cached in the copy: the handler call's decode finds it
        self.copy = copy

    def take(self, run: Sequence[ConsumerMessage]) -> StreamMessage[Any] | None:
        copy, self.copy = self.copy, None  # once: a second call is another attempt
        if copy is None or len(run) != len(self.members):
            return None
        if any(a is not b for a, b in zip(run, self.members, strict=True)):
            return None
        return copy


# --- settling ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Member:
    record: Any  # the Kafka client's own record
    incoming: ConsumerMessage

    @property
    def partition(self) -> tuple[str, int]:
        return coordinates(self.incoming)[:2]

    @property
    def offset(self) -> int:
        return coordinates(self.incoming)[2]


def coordinates(incoming: ConsumerMessage) -> tuple[str, int, int]:
    """``(topic, partition, offset)`` of a Kafka record's neutral view: read there, not on the
    record, whose shape differs between Kafka clients (aiokafka, Confluent's)."""
    topic, partition, offset = incoming.topic, incoming.partition, incoming.offset
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


class SubscriberSide:
    """What both settle-path transports of the middleware (per delivery, per batch) take from
    the subscriber: its store, whether it is stopping (it then stops retrying publishes)."""

    idem: Idempotency
    subscriber: Any

    @property
    def store(self) -> PostgresStore:
        return self.idem.store

    def stopping(self) -> bool:
        return not getattr(self.subscriber, "running", True)

    def permanent(self, exc: BaseException) -> bool:
        return self.idem.transport.permanent(exc)


class MemberSettler(SubscriberSide):
    """What the NATS and Redis batch settlers share: each member is settled on its own, its
    dead letter and notices named after the member's ``source`` (its subject or stream).
    ``transport``: the broker side (``_Nats`` or ``_Redis``); members carry ``incoming``."""

    transport: Any

    def source(self, delivery: Any) -> str:
        raise NotImplementedError

    def dead_letter_destination(self, delivery: Any) -> str:
        return self.idem.dead_letter_destination(self.source(delivery))

    def body_size(self, delivery: Any) -> int:
        return len(delivery.incoming.body)

    def notice_body(self, delivery: Any, verdict: Verdict, with_original: bool) -> bytes:
        if not with_original:
            return reconcile_notice(verdict)
        return reconcile_notice(verdict, delivery.incoming, self.source(delivery))

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self.transport.notice(scope, key, body)

    async def send_redispatch(self, notice: Notice) -> None:
        await self.transport.redispatch(notice)


class _BatchSettler(SubscriberSide):
    """The settle path's transport (``consumer_idem.transports.settle.Transport``) for the
    members of one batch: an ack advances its partition's commit, a retry or a hand-back stops
    its partition there (it is sought back after the wait)."""

    def __init__(self, idem: Idempotency, subscriber: Any) -> None:
        self.idem = idem
        self.subscriber = subscriber
        self.stats = idem.stats
        self.transport = cast("_Kafka", idem.transport)  # members() checked it
        self.done: dict[tuple[str, int], int] = {}  # partition -> next offset to commit
        self.back: dict[tuple[str, int], int] = {}  # partition -> offset to deliver again from
        self.wait = 0.0

    async def ack(self, delivery: _Member) -> None:
        self.done[delivery.partition] = delivery.offset + 1

    async def retry_later(self, delivery: _Member, verdict: Verdict) -> None:
        log.info("retrying in %.2fs (%s)", verdict.retry_after, verdict.reason)
        self.wait = max(self.wait, verdict.retry_after)
        await self.give_back(delivery)

    async def give_back(self, delivery: _Member) -> None:
        self.back.setdefault(delivery.partition, delivery.offset)

    def dead_letter_destination(self, delivery: _Member) -> str:
        return self.idem.dead_letter_destination(delivery.partition[0])

    def body_size(self, delivery: _Member) -> int:
        return len(delivery.incoming.body)

    async def send_dead_letter(
        self, delivery: _Member, verdict: Verdict, body_dropped: bool
    ) -> None:
        await self.transport.dead_letter_record(
            delivery.record, verdict, self.dead_letter_destination(delivery), body_dropped
        )

    def notice_body(self, delivery: _Member, verdict: Verdict, with_original: bool) -> bytes:
        if not with_original:
            return reconcile_notice(verdict)
        return reconcile_notice(verdict, delivery.incoming, delivery.partition[0])

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self.transport.notice(scope, key, body)

    async def send_redispatch(self, notice: Notice) -> None:
        await self.transport.redispatch(notice)


async def settle_batch(
    idem: Idempotency,
    subscriber: Any,
    consumer: Any,
    run: Sequence[ConsumerMessage],
    verdicts: Sequence[Verdict | None],
) -> bool:
    """Settle each member in order (``verdicts[i]`` for ``run[i]``; missing or None: not
    decided); then commit every partition up to its first member not settled, and seek each
    such partition back to it (after the longest wait asked for). True when all were settled.
    A NATS batch: each member acked or ``nak``-ed (`consumer_idem.faststream.nats_batch`); a
    Redis batch: each ``XACK``-ed or left pending (`consumer_idem.faststream.redis_batch`)."""
    from consumer_idem.faststream.nats_side import _Nats
    from consumer_idem.faststream.redis_side import _Redis

    if isinstance(idem.transport, _Nats):
        from consumer_idem.faststream import nats_batch

        return await nats_batch.settle_batch(idem, subscriber, run, verdicts)
    if isinstance(idem.transport, _Redis):
        from consumer_idem.faststream import redis_batch

        return await redis_batch.settle_batch(idem, subscriber, run, verdicts)
    settler = _BatchSettler(idem, subscriber)
    stats, done, back = settler.stats, settler.done, settler.back
    for i, incoming in enumerate(run):
        topic, number, offset = coordinates(incoming)
        partition = (topic, number)
        if partition in back:
            continue  # after a member that waits: delivered again with it, in order
        verdict = verdicts[i] if i < len(verdicts) else None
        if verdict is None:  # the core stopped at a wait: the rest was not decided
            back.setdefault(partition, offset)
        elif settled_by_commit(verdict):  # the commit settled it: ack, as the settle path would
            settle.count_ack(stats, verdict)
            stats.processed += 1
            done[partition] = offset + 1  # inlined ack(): this loop runs per record
        else:
            await settle.settle(settler, _Member(incoming.raw, incoming), verdict)
    transport = settler.transport
    # each partition up to its first record not settled (acks come in order, and none after
    # a stop): in the background, while the next batch is fetched
    transport.commit_soon(consumer, settler.done)
    if settler.back:
        await settle.pause(settler.wait, settler.stopping)
        await transport.seek(consumer, settler.back)
        return False
    return True
