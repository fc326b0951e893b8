"""Dead-letter replay against real Kafka / RabbitMQ and Postgres."""

from __future__ import annotations

import uuid
from typing import Any

import aio_pika
import asyncpg
from aiokafka import AIOKafkaProducer

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer, kafka_coordinates
from consumer_idem.cli.settings import Settings
from consumer_idem.operations.replay import kafka_source, rabbit_source, replay
from examples.payments_producer import plan
from handlers.payments import ledger_consumer, record_payment
from tests._payments import ledger_count


async def test_replay_of_a_thousand_message_dlq_with_six_hundred_done(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
) -> None:
    run_id = f"rp{uuid.uuid4().hex[:6]}"
    consumer = ledger_consumer(store)
    messages = plan(1000, 0.0, 8, run_id)
    dlq = await kafka_topic_factory("payments.requests.dlq", partitions=2)
    for m in messages[:600]:  # these completed before their copies were dead-lettered
        verdict = await consumer.process(
            ConsumerMessage(m.body, {"idempotency-key": m.key.encode()})
        )
        assert verdict.action.value == "ack"
    for i, m in enumerate(messages):
        await kafka_producer.send(
            dlq,
            value=m.body,
            key=m.key.encode(),
            headers=[
                ("idempotency-key", m.key.encode()),
                ("x-original-topic", b"payments.requests"),
                ("x-original-partition", b"0"),
                ("x-original-offset", str(i).encode()),
                ("x-dead-letter-reason", b"store_unavailable"),
            ],
        )
    await kafka_producer.flush()
    bootstrap = settings.kafka_bootstrap

    dry = await replay(
        consumer,
        kafka_source(dlq, group_id=f"{run_id}-replay", bootstrap_servers=bootstrap, commit=False),
        dry_run=True,
    )
    assert (dry.read, dry.skip, dry.execute) == (1000, 600, 400)
    assert await ledger_count(pg_pool, run_id) == 600  # a dry run changes nothing

    done = await replay(
        consumer,
        kafka_source(dlq, group_id=f"{run_id}-replay", bootstrap_servers=bootstrap),
        rate=5000,
    )
    assert (done.read, done.skip, done.execute) == (1000, 600, 400)
    assert await ledger_count(pg_pool, run_id) == 1000  # exactly 400 new effects

    resumed = await replay(
        consumer, kafka_source(dlq, group_id=f"{run_id}-replay", bootstrap_servers=bootstrap)
    )
    assert resumed.read == 0  # the group committed as it went: nothing left to replay
    again = await replay(
        consumer, kafka_source(dlq, group_id=f"{run_id}-again", bootstrap_servers=bootstrap)
    )
    assert (again.read, again.execute, again.skip) == (1000, 0, 1000)
    assert await ledger_count(pg_pool, run_id) == 1000


async def test_a_dead_letter_copy_keeps_its_original_coordinates_as_key(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    scope: str,
) -> None:
    run_id = f"co{uuid.uuid4().hex[:6]}"
    consumer = idempotent_consumer(store, scope=scope, key=kafka_coordinates())(record_payment)
    body = plan(1, 0.0, 1, run_id)[0].body
    original = ConsumerMessage(body, topic="orders", partition=3, offset=41)
    assert (await consumer.process(original)).action.value == "ack"
    dlq = await kafka_topic_factory("orders.dlq")
    await kafka_producer.send_and_wait(
        dlq,
        value=body,
        headers=[
            ("x-original-topic", b"orders"),
            ("x-original-partition", b"3"),
            ("x-original-offset", b"41"),
        ],
    )
    report = await replay(
        consumer, kafka_source(dlq, group_id=run_id, bootstrap_servers=settings.kafka_bootstrap)
    )
    assert (report.read, report.skip, report.execute) == (1, 1, 0)
    assert await ledger_count(pg_pool, run_id) == 1


async def test_rabbit_dlq_replay_acks_as_it_goes(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queue_name: str,
) -> None:
    run_id = f"rq{uuid.uuid4().hex[:6]}"
    consumer = ledger_consumer(store)
    messages = plan(100, 0.0, 2, run_id)
    for m in messages[:60]:
        await consumer.process(ConsumerMessage(m.body, {"idempotency-key": m.key.encode()}))
    channel = await amqp_connection.channel(publisher_confirms=True)
    queue = await channel.declare_queue(
        queue_name, durable=True, arguments={"x-queue-type": "quorum"}
    )
    for m in messages:
        await channel.default_exchange.publish(
            aio_pika.Message(m.body, headers={"idempotency-key": m.key}), routing_key=queue_name
        )
    url = settings.amqp_url
    dry = await replay(consumer, rabbit_source(queue_name, url=url, requeue_all=True), dry_run=True)
    assert (dry.read, dry.skip, dry.execute) == (100, 60, 40)
    done = await replay(consumer, rabbit_source(queue_name, url=url))
    assert (done.read, done.skip, done.execute) == (100, 60, 40)
    assert await ledger_count(pg_pool, run_id) == 100
    left = await channel.declare_queue(queue_name, passive=True)
    assert left.declaration_result.message_count == 0
    await queue.delete(if_unused=False, if_empty=False)
    await channel.close()
