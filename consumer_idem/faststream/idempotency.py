"""The [`Idempotency`][consumer_idem.faststream.idempotency.Idempotency] middleware factory:
configuration, the core consumer, publishing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Unpack

from consumer_idem.consumer import (
    IdempotentConsumer,
)
from consumer_idem.errors import (
    IdempotencyConfigError,
)
from consumer_idem.execution import Attempt
from consumer_idem.faststream import batch, startup
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.faststream.budget import BrokerBudget, RabbitBudget
from consumer_idem.faststream.confluent_side import _Confluent
from consumer_idem.faststream.context import (
    _CURRENT,
    DEFAULT_RECONCILE_DESTINATION,
    IdempotencyContext,
)
from consumer_idem.faststream.handler_call import _ACKED, _call, guarded
from consumer_idem.faststream.kafka_side import _Kafka
from consumer_idem.faststream.middleware import _Middleware
from consumer_idem.faststream.nats_side import _Nats
from consumer_idem.faststream.rabbit_side import _Rabbit
from consumer_idem.faststream.redis_side import _Redis
from consumer_idem.faststream.relay import OutboxRelayTask, faststream_route
from consumer_idem.faststream.results import _ACK_ONLY, _store_form
from consumer_idem.faststream.settler import _Settler, _Transport
from consumer_idem.faststream.typed import SubscriberTypes
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice
from consumer_idem.options import ConsumerArgs, ConsumerOptions, Mode
from consumer_idem.outbox import (
    OutgoingMessage,
    attach_dispatcher,
    outbox_for,
    send_all,
)
from consumer_idem.result_types import FROM_ANNOTATION
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports import settle
from consumer_idem.transports.settle import RunnerStats

log = logging.getLogger("consumer_idem.faststream")


class Idempotency:
    """A FastStream middleware factory making subscribers idempotent (see the module docstring).

    ``store``: a [`PostgresStore`][consumer_idem.PostgresStore], or a callable returning it (for
    apps that open their pool on startup). ``broker``: the ``KafkaBroker`` (aiokafka's, or
    Confluent's from ``faststream.confluent``, see `consumer_idem.faststream.confluent_side`),
    ``RabbitBroker``, ``NatsBroker`` (JetStream subscribers only, see
    `consumer_idem.faststream.nats_side`) or ``RedisBroker`` (stream consumer groups only, see
    `consumer_idem.faststream.redis_side`) the subscribers belong to; dead letters,
    reconciliation notices and re-dispatches are published through it.
    The other arguments are those of
    [`consumer_idem.idempotent_consumer`][consumer_idem.idempotent_consumer], plus:

    * ``dead_letter``: destination for poison messages: a name, or a callable of the source
      topic/queue (default ``<source>.dlq``);
    * ``reconcile_destination``: topic or queue for notices of ``unknown`` outcomes;
    * ``max_deliveries`` (RabbitMQ): a key whose handler ran this many times without settling
      (it keeps failing, or killing the consumer) is dead-lettered without running again;
      only the key's own runs count, not the broker's returns, and a key whose record says it
      completed is acked, never dead-lettered (`consumer_idem.faststream.budget`); (NATS) a
      message whose handler fails on its ``max_deliveries``-th JetStream delivery is
      dead-lettered (a wait for the store never is); (Redis) likewise on the entry's
      ``max_deliveries``-th delivery, counted in the group's pending-entries list;
    * ``declare`` (RabbitMQ): declare the dead-letter and notice queues (durable, quorum);
    * ``max_hold`` (RabbitMQ): how long a delivery waiting for the store or for another owner
      stays in hand before it is handed back as a copy (keep it under ``consumer_timeout``);
    * ``result_type``: what a subscriber's result is read back as, on the first run and on
      every replay alike (default: each handler's return annotation; a batch handler's
      ``list[X]``: ``X``); ``on_execute`` / ``on_replay``: called with the verdict of each
      real execution / replay, its ``result`` what the handler returned (`.typed`).

    It also serves as the transport of a [`Sweeper`][consumer_idem.operations.reconcile.Sweeper] or
    [`Reconciler`][consumer_idem.operations.reconcile.Reconciler] (``publish_notice``,
    ``redispatch``),
    and as the sender of the outbox (``send_batch``): what a handler publishes through
    `IdempotentOutbox` goes out through ``broker`` right after the commit, and a relay
    sends what a crash or an outage left behind (``idem.outbox_relay``, see
    `consumer_idem.faststream.relay`):

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
        # read here, not by the core: its handler is this class's (see .typed)
        self.result_types = SubscriberTypes(options.pop("result_type", FROM_ANNOTATION))
        self.on_execute = options.pop("on_execute", None)
        self.on_replay = options.pop("on_replay", None)
        # the core stores the envelope as JSON, untyped (popped above: none left to pass)
        self.options = replace(ConsumerOptions(scope=scope, mode=mode, **options), result_type=None)
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
        self.route = faststream_route(broker, _route_transport(self.transport))
        #: the relay of what a crash or an outage left in the outbox (see .relay)
        self.outbox_relay = OutboxRelayTask(self, outbox_relay, app)
        #: the delivery budget (RabbitMQ, NATS, Redis: brokers that tell redeliveries), counted per
        #: key in Postgres; None on Kafka (no per-record redelivery counter)
        self.budget: BrokerBudget | None = None
        if isinstance(self.transport, _Rabbit):
            self.budget = RabbitBudget(self)
        elif isinstance(self.transport, _Nats | _Redis):
            self.budget = BrokerBudget(self, self.transport.delivered_before)
        self._batch_consumer: IdempotentConsumer | None = None
        # the subscribers found safe, each with its id (held, so that the id is not reused)
        self._checked: dict[int, Any] = {}
        startup.guard_start(self, broker)  # unsafe subscribers refused before any fetch

    def check_subscriber(self, subscriber: Any) -> None:
        """Refuse a subscriber that would lose messages under the middleware (its transport's
        rules, its ack policy). Once found safe it is not asked again: what is checked is
        fixed once the broker runs, and reading it (FastStream's configs, built on each
        read) cost more than the rest of a delivery's bookkeeping."""
        if id(subscriber) in self._checked:
            return
        self.transport.check(subscriber)
        unsafe = startup.unsafe_ack_policy(subscriber)  # a test broker skips start()
        if unsafe is not None:
            raise IdempotencyConfigError(unsafe)
        self._checked[id(subscriber)] = subscriber

    def _build(self, store: PostgresStore) -> IdempotentConsumer:
        attach_dispatcher(store, self, [self.scope])  # the outbox goes out through the broker
        return IdempotentConsumer(self._handle, store=store, options=self.options)

    def _transport_for(self, broker: Any) -> _Transport:
        kinds: list[tuple[str, str, type[_Kafka] | type[_Rabbit] | type[_Nats] | type[_Redis]]] = [
            ("faststream.kafka", "KafkaBroker", _Kafka),
            ("faststream.confluent", "KafkaBroker", _Confluent),
            ("faststream.rabbit", "RabbitBroker", _Rabbit),
            ("faststream.nats", "NatsBroker", _Nats),
            ("faststream.redis", "RedisBroker", _Redis),
        ]
        for module, name, transport in kinds:
            try:
                broker_type = getattr(__import__(module, fromlist=[name]), name)
            except ImportError:
                continue
            if isinstance(broker, broker_type):
                return transport(self, broker)
        raise IdempotencyConfigError(
            "broker must be a FastStream KafkaBroker, RabbitBroker, NatsBroker or RedisBroker, not "
            f"{type(broker).__name__}"
        )

    # --- configuration the transports read -----------------------------------------------------

    @property
    def consumer(self) -> IdempotentConsumer:
        """The core [`IdempotentConsumer`][consumer_idem.IdempotentConsumer] (built on first use
        when ``store`` is a
        callable)."""
        if self._consumer is None:
            store = self._store_source
            assert not isinstance(store, PostgresStore)
            self._consumer = self._build(store())
        return self._consumer

    @property
    def batch_consumer(self) -> IdempotentConsumer:
        """The core consumer of Kafka batch subscribers: the same options in batch mode (see
        `consumer_idem.faststream.batch`)."""
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
        if result is None:
            # stored as SQL NULL, as the core stores None: the completion then writes nothing
            # more than the claim did (an envelope was one UPDATE of the row per message),
            # and a replay publishes None again, as the first run did
            return None
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
            await transport.publish(message.destination, message.body, message.key, message.headers)
            return
        if isinstance(transport, _Nats | _Redis):
            headers = {k: v.decode("utf-8", "backslashreplace") for k, v in message.headers}
            await transport.publish(message.destination, message.body, headers)
            return
        assert isinstance(transport, _Rabbit)
        from consumer_idem.transports.rabbit import outgoing_message

        amqp = outgoing_message(message)
        await transport.publish(
            message.destination,
            message.body,
            dict(amqp.headers),
            message_id=amqp.message_id,
            content_type=amqp.content_type,
        )


def _route_transport(transport: _Transport) -> str:
    if isinstance(transport, _Kafka):
        return "kafka"
    if isinstance(transport, _Redis):
        return "redis"
    return "nats" if isinstance(transport, _Nats) else "amqp"
