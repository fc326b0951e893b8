"""Mistakes refused at start-up, nothing lost: a FastStream subscriber whose ack policy would
settle deliveries behind the Idempotency middleware's back stops the app before it fetches
anything, on the real Kafka and RabbitMQ; a correctly configured consumer then gets every
message."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.rabbit import QueueType, RabbitBroker, RabbitQueue, RabbitRouter

from consumer_idem import IdempotencyConfigError, PostgresStore, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection
from tests._faststream import effect_count, write_effect
from tests._payments import wait_until
from tests.conftest import unique

KEY = header("idempotency-key")
REFUSAL = r"ack_policy=AckPolicy\.(ACK_FIRST|REJECT_ON_ERROR).*AckPolicy\.MANUAL"


async def record(
    data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
) -> None:
    await write_effect(conn, current, data["n"])


async def refused(app: FastStream) -> None:
    """Run the app as ``faststream run`` does: it must stop at once with the refusal."""
    with pytest.raises(IdempotencyConfigError, match=REFUSAL):
        await asyncio.wait_for(app.run(), 30)


async def consume_three(broker: Any, idem: Idempotency) -> None:
    """Run the corrected app until it has processed the three messages."""
    await broker.start()
    try:

        async def all_done() -> bool:
            return idem.stats.processed >= 3

        await wait_until(all_done, 60, "the three messages to be processed")
    finally:
        await broker.stop()


async def test_a_kafka_app_with_the_default_ack_policy_does_not_start_and_loses_nothing(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fsack")
    group = unique("fsackg")
    for n in range(3):
        await kafka_producer.send_and_wait(
            topic, b'{"n": %d}' % n, headers=[("idempotency-key", f"k{n}".encode())]
        )

    def app(ack_policy: AckPolicy | None) -> tuple[FastStream, KafkaBroker, Idempotency]:
        broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
        idem = Idempotency(store, broker=broker, scope=scope, key=KEY, backoff=(0.05, 0.5))
        router = KafkaRouter(middlewares=[idem])
        policy = {} if ack_policy is None else {"ack_policy": ack_policy}
        router.subscriber(topic, group_id=group, auto_offset_reset="earliest", **policy)(record)
        broker.include_router(router)
        return FastStream(broker), broker, idem

    careless, broker, _ = app(None)  # FastStream's default on Kafka: ACK_FIRST, auto-commit
    await refused(careless)
    await broker.stop()
    assert await kafka_admin.list_consumer_group_offsets(group) == {}  # nothing committed

    _, broker, idem = app(AckPolicy.MANUAL)
    await consume_three(broker, idem)
    assert await effect_count(pg_pool, scope) == 3


async def test_a_rabbitmq_app_with_the_default_ack_policy_does_not_start_and_loses_nothing(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    queue = unique("fsackq")
    channel = await amqp_connection.channel(publisher_confirms=True)
    declared = await channel.declare_queue(
        queue, durable=True, arguments={"x-queue-type": "quorum"}
    )
    try:
        for n in range(3):
            await channel.default_exchange.publish(
                aio_pika.Message(b'{"n": %d}' % n, headers={"idempotency-key": f"k{n}"}),
                routing_key=queue,
            )

        def app(ack_policy: AckPolicy | None) -> tuple[FastStream, RabbitBroker, Idempotency]:
            broker = RabbitBroker(settings.amqp_url)
            idem = Idempotency(store, broker=broker, scope=scope, key=KEY, backoff=(0.05, 0.5))
            router = RabbitRouter(middlewares=[idem])
            policy = {} if ack_policy is None else {"ack_policy": ack_policy}
            router.subscriber(RabbitQueue(queue, queue_type=QueueType.QUORUM), **policy)(record)
            broker.include_router(router)
            return FastStream(broker), broker, idem

        careless, broker, _ = app(None)  # FastStream's default on RabbitMQ: REJECT_ON_ERROR
        await refused(careless)
        await broker.stop()
        passive = await channel.declare_queue(queue, passive=True)
        assert passive.declaration_result.message_count == 3  # all still there, unconsumed

        _, broker, idem = app(AckPolicy.MANUAL)
        await consume_three(broker, idem)
        assert await effect_count(pg_pool, scope) == 3
    finally:
        await declared.delete(if_unused=False, if_empty=False)
        await channel.close()


async def test_under_a_test_broker_a_subscriber_without_manual_acks_is_refused_unrun(
    store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    """FastStream's test brokers do not run ``broker.start()``: the first message is refused
    instead, so the mistake shows in the app's own tests, not only in production."""
    from faststream.rabbit import TestRabbitBroker

    broker = RabbitBroker()
    router = RabbitRouter(middlewares=[Idempotency(store, broker=broker, scope=scope, key=KEY)])
    router.subscriber("in")(record)  # REJECT_ON_ERROR, the RabbitMQ default
    broker.include_router(router)
    async with TestRabbitBroker(broker):
        with pytest.raises(IdempotencyConfigError, match=REFUSAL):
            await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k1"})
    assert await effect_count(pg_pool, scope) == 0
