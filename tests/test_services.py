"""Smoke tests: each service really answers, with the features the library relies on."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import aio_pika
import asyncpg
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumer_idem.cli.settings import Settings
from tests._failover import FailoverPair
from tests.conftest import ROOT_DIR, with_database


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


async def test_pgbouncer_hands_a_server_connection_back_after_each_transaction(
    pgbouncer_dsn: str, own_database: str
) -> None:
    """Transaction pooling, not session pooling: once one client's statement is done, another
    client gets the same server connection (its own database: nobody else in that pool)."""
    through = with_database(pgbouncer_dsn, own_database.rsplit("/", 1)[1])
    first = await asyncpg.connect(through, statement_cache_size=0)
    second = await asyncpg.connect(through, statement_cache_size=0)
    try:
        backend = await first.fetchval("SELECT pg_backend_pid()")
        assert await second.fetchval("SELECT pg_backend_pid()") == backend
        async with first.transaction():  # held for a whole transaction: no longer shared
            mine = await first.fetchval("SELECT pg_backend_pid()")
            assert await second.fetchval("SELECT pg_backend_pid()") != mine
    finally:
        await first.close()
        await second.close()


async def test_the_standby_replays_what_the_primary_commits(failover_pair: FailoverPair) -> None:
    database = failover_pair.database
    primary = await asyncpg.connect(with_database(failover_pair.primary_dsn, database))
    standby = await asyncpg.connect(with_database(failover_pair.standby_dsn, database))
    try:
        await primary.execute("CREATE TABLE smoke (id int)")
        await primary.execute("INSERT INTO smoke VALUES (1)")  # synchronous: on the standby
        assert await standby.fetchval("SELECT pg_is_in_recovery()")
        deadline = time.monotonic() + 10
        while not await standby.fetchval("SELECT to_regclass('smoke') IS NOT NULL"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert await standby.fetchval("SELECT count(*) FROM smoke") == 1
        assert await failover_pair.promote_standby() < 30
        await standby.execute("INSERT INTO smoke VALUES (2)")  # writable once promoted
    finally:
        await primary.close()
        await standby.close()


@pytest.mark.parametrize(
    ("variable", "test", "named"),
    [
        (
            "CONSUMER_IDEM_PGBOUNCER_DSN",
            "test_pgbouncer_hands_a_server_connection_back_after_each_transaction",
            "PgBouncer is not reachable",
        ),
        (
            "CONSUMER_IDEM_PG_STANDBY_DSN",
            "test_the_standby_replays_what_the_primary_commits",
            "The fail-over pair's standby is not reachable",
        ),
    ],
)
async def test_a_missing_pgbouncer_or_standby_fails_its_tests_under_ci(
    variable: str, test: str, named: str
) -> None:
    """Never a skip: CI must not go green on a machine without PgBouncer or the standby."""
    nowhere = "postgresql://postgres:postgres@127.0.0.1:1/postgres"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        f"tests/test_services.py::{test}",
        cwd=ROOT_DIR,
        env={**os.environ, "CI": "true", variable: nowhere},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    text = out.decode(errors="replace")
    assert proc.returncode == 1, text
    assert "1 error" in text or "1 failed" in text, text
    assert "skipped" not in text, text
    assert f"{named} at {nowhere} (CI=true)" in text, text
