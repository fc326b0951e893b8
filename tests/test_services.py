"""Smoke tests: each service really answers, with the features the library relies on."""

from __future__ import annotations

from typing import Any

import aio_pika
import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumer_idem.cli.settings import Settings


async def test_postgres_round_trip(pg_pool: asyncpg.Pool) -> None:
    async with pg_pool.acquire() as conn:
        await conn.execute("CREATE TEMP TABLE smoke (id int primary key, body text)")
        await conn.execute("INSERT INTO smoke VALUES ($1, $2)", 1, "hello")
        assert await conn.fetchval("SELECT body FROM smoke WHERE id = 1") == "hello"
        database = await conn.fetchval("SELECT current_database()")
        assert database.startswith("consumer_idem_test_")


async def test_kafka_manual_commit_is_seen_by_the_next_group_member(
    settings: Settings, kafka_topic_factory: Any, kafka_producer: AIOKafkaProducer
) -> None:
    topic = await kafka_topic_factory("smoke")
    for i in range(4):
        await kafka_producer.send_and_wait(topic, f"m{i}".encode())
    group = f"{topic}-group"
    tp = TopicPartition(topic, 0)

    first = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await first.start()
    try:
        seen = []
        while len(seen) < 2:
            batch = await first.getmany(tp, timeout_ms=5000, max_records=2 - len(seen))
            seen.extend(r.value for r in batch.get(tp, []))
        assert seen == [b"m0", b"m1"]
        await first.commit({tp: 2})  # offset + 1 of the last processed record
    finally:
        await first.stop()

    second = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await second.start()
    try:
        assert await second.committed(tp) == 2
        record = await second.getone()
        assert (record.offset, record.value) == (2, b"m2")
    finally:
        await second.stop()


async def test_rabbitmq_confirmed_publish_consume_ack(
    amqp_connection: aio_pika.abc.AbstractConnection, queue_name: str
) -> None:
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        queue = await channel.declare_queue(queue_name, durable=True)
        confirmation = await channel.default_exchange.publish(
            aio_pika.Message(
                b"payload", message_id="m-1", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
            ),
            routing_key=queue_name,
        )
        assert confirmation is not None  # a broker ack of the publish
        message = await queue.get(timeout=5)
        assert message is not None
        assert (message.body, message.message_id) == (b"payload", "m-1")
        await message.ack()
        assert await queue.get(fail=False) is None
        await queue.delete()
    finally:
        await channel.close()


async def test_redis_set_nx_with_expiry(redis_client: aioredis.Redis, redis_prefix: str) -> None:
    key = redis_prefix + "lock"
    assert await redis_client.set(key, "owner-a", nx=True, ex=30) is True
    assert await redis_client.set(key, "owner-b", nx=True, ex=30) is None
    assert await redis_client.get(key) == b"owner-a"
    assert 0 < await redis_client.ttl(key) <= 30
