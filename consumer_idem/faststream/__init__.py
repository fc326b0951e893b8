"""FastStream integration: idempotent subscribers on ``KafkaBroker`` and ``RabbitBroker``.

[`Idempotency`][consumer_idem.faststream.Idempotency] is a FastStream middleware. Put it on a router
(one per scope) or on the
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
   injection (`IdempotentConnection`, `IdempotentAttempt`, `CurrentIdempotency`);
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
[`IdempotencyConfigError`][consumer_idem.faststream.IdempotencyConfigError]; FastStream's
``max_workers`` with ``AckPolicy.MANUAL`` (one
consumer per worker, each partition on one of them) is accepted.

The package's modules, by what they do: `.idempotency` (the middleware factory),
`.middleware` (one delivery), `.context` (what a handler injects), `.results`
(stored and published forms), `.handler_call`, `.settler` with `.kafka_side` and
`.rabbit_side` (settling per broker), `.batch`, `.budget`, `.relay`,
`.startup`, `.unrouted`; what FastStream keeps only in private attributes is read in
`._compat` alone.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import faststream  # noqa: F401 - the faststream extra
except ImportError as exc:
    raise missing("faststream", exc, __name__) from exc

from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.faststream.batch import CurrentIdempotencyBatch, IdempotencyBatchContext
from consumer_idem.faststream.context import (
    CONTEXT_NAME,
    DEFAULT_RECONCILE_DESTINATION,
    CurrentIdempotency,
    IdempotencyContext,
    IdempotentAttempt,
    IdempotentConnection,
    IdempotentOutbox,
)
from consumer_idem.faststream.handler_call import guarded
from consumer_idem.faststream.idempotency import Idempotency
from consumer_idem.faststream.relay import OutboxRelayTask, faststream_route
from consumer_idem.faststream.settler import _Settler  # noqa: F401 - kept importable from here

__all__ = [
    "CONTEXT_NAME",
    "DEFAULT_RECONCILE_DESTINATION",
    "CurrentIdempotency",
    "CurrentIdempotencyBatch",
    "Idempotency",
    "IdempotencyBatchContext",
    "IdempotencyConfigError",
    "IdempotencyContext",
    "IdempotentAttempt",
    "IdempotentConnection",
    "IdempotentOutbox",
    "OutboxRelayTask",
    "faststream_route",
    "guarded",
]
