"""The payments consumer as a FastStream app: a Kafka and a RabbitMQ subscriber, one store.

    faststream run examples.faststream_app:app

Both subscribers consume payment requests (the message contract of ``payments_producer``:
JSON ``{"payment_id", "customer_id", "amount_cents", "currency"}`` with the key in the
``idempotency-key`` header) and do the demo's effect (one ``demo_ledger`` row, the balance in
``demo_accounts``) in the transaction of the idempotency record, under one scope: a payment
sent to both brokers is still booked once. Each handler returns a confirmation, which the
subscriber's publisher sends on; a duplicate re-sends the stored confirmation, byte for byte.

Environment (defaults in brackets): the ``CONSUMER_IDEM_*`` connection settings, and
``PAYMENTS_TOPIC`` [payments.requests] (the Kafka topic and the RabbitMQ queue),
``PAYMENTS_RESULTS`` [payments.recorded], ``PAYMENTS_GROUP`` [payments-ledger-faststream],
``PAYMENTS_INSTANCE_ID`` [none] (Kafka static membership: a restarted process takes its
partitions back at once), ``PAYMENTS_PREFETCH`` [32] (RabbitMQ messages in hand at once),
``PAYMENTS_SLOW_MS`` [0] (a sleep in each handler, for crash tests).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.rabbit import Channel, QueueType, RabbitBroker, RabbitQueue, RabbitRouter

from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotencyContext,
    IdempotentConnection,
)
from handlers.payments import LEDGER_SCOPE, ensure_tables, parse_payment, record_payment

settings = load_settings()
TOPIC = os.environ.get("PAYMENTS_TOPIC", "payments.requests")
RESULTS = os.environ.get("PAYMENTS_RESULTS", "payments.recorded")
GROUP = os.environ.get("PAYMENTS_GROUP", "payments-ledger-faststream")
SLOW_MS = float(os.environ.get("PAYMENTS_SLOW_MS", "0"))
INSTANCE_ID = os.environ.get("PAYMENTS_INSTANCE_ID") or None
PREFETCH = int(os.environ.get("PAYMENTS_PREFETCH", "32"))

# acks="all": a dead letter or notice is durable before the offset of its message moves
kafka = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
# a bounded prefetch: FastStream handles the messages in hand concurrently
rabbit = RabbitBroker(settings.amqp_url, default_channel=Channel(prefetch_count=PREFETCH))

# made now, its pool opened by open_store below (or by its first use)
store = PostgresStore.from_dsn(
    settings.pg_dsn, schema=settings.schema_name, min_size=2, max_size=10
)


# One middleware per broker (it publishes dead letters and notices through its broker), both
# on the same store and scope.
kafka_router = KafkaRouter(
    middlewares=[
        Idempotency(store, broker=kafka, scope=LEDGER_SCOPE, key=header("idempotency-key"))
    ]
)
rabbit_router = RabbitRouter(
    middlewares=[
        Idempotency(store, broker=rabbit, scope=LEDGER_SCOPE, key=header("idempotency-key"))
    ]
)


async def book(idem: IdempotencyContext, conn: asyncpg.Connection) -> dict[str, Any]:
    """The demo effect, on the idempotency transaction's connection; the confirmation."""
    await record_payment(idem.message, conn)
    if SLOW_MS:
        await asyncio.sleep(SLOW_MS / 1000)
    payment = parse_payment(idem.message)
    return {
        "payment_id": payment.payment_id,
        "customer_id": payment.customer_id,
        "amount_cents": payment.amount_cents,
        "currency": payment.currency,
        "idempotency_key": idem.key,
    }


@kafka_router.subscriber(
    TOPIC,
    group_id=GROUP,
    group_instance_id=INSTANCE_ID,
    ack_policy=AckPolicy.MANUAL,  # the middleware commits offset+1 after the Postgres commit
    auto_offset_reset="earliest",
)
@kafka_router.publisher(RESULTS)
async def kafka_payment(idem: CurrentIdempotency, conn: IdempotentConnection) -> dict[str, Any]:
    return await book(idem, conn)


@rabbit_router.subscriber(
    RabbitQueue(TOPIC, queue_type=QueueType.QUORUM),  # quorum: x-delivery-count is kept
    ack_policy=AckPolicy.MANUAL,
)
@rabbit_router.publisher(RESULTS, persist=True)
async def rabbit_payment(idem: CurrentIdempotency, conn: IdempotentConnection) -> dict[str, Any]:
    return await book(idem, conn)


kafka.include_router(kafka_router)
rabbit.include_router(rabbit_router)


async def open_store() -> None:
    await store.open()  # an unreachable database fails the start-up
    await store.migrate()
    async with store.pool.acquire() as conn:
        await ensure_tables(conn)
    # the confirmations' queue, before any subscriber runs: the publisher's publishes are
    # mandatory, and an unroutable confirmation would hold its payment back
    await rabbit.connect()
    await rabbit.declare_queue(RabbitQueue(RESULTS, queue_type=QueueType.QUORUM))


async def close_store() -> None:
    await store.close()


app = FastStream(
    kafka,
    rabbit,
    on_startup=[open_store],
    after_shutdown=[close_store],
)
