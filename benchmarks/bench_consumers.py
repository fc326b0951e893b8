"""Consumers on a pre-filled topic / queue (20,000 messages), each running the demo effect
(one ledger row + the account balance), measured in one run against plain baselines:

Kafka (one partition, so "per partition" is the figure itself):
  (a) a plain aiokafka consumer: per fetched batch, the same set-based effect in one transaction,
      then one offset commit; no idempotency.
  (b) ``@idempotent_consumer``, one message per transaction (two statements per message).
  (c) ``@idempotent_consumer`` in batch mode (one transaction per fetched batch).
RabbitMQ: plain aio-pika (prefetch 32, effect in a transaction, ack) vs. the decorator.

Rates run from the first settled message to the last, so joining the group is not counted.
Each run reads the whole topic with a new consumer group and, for the decorator, a new scope.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import asyncpg
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.common import entry, scratch_database
from consumer_idem import PostgresStore, header, idempotent_consumer
from consumer_idem.settings import load_settings
from consumer_idem.transports.kafka import KafkaRunner, to_message
from consumer_idem.transports.rabbit import RabbitRunner
from consumer_idem.transports.rabbit import to_message as amqp_message
from examples.payments_producer import plan, send_kafka, send_rabbit
from handlers.payments import ensure_tables, record_payment, record_payments

N = 20_000


class Clock:
    """First-to-last settled message."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.count = 0

    def tick(self, n: int = 1) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.count += n

    def rate(self) -> float:
        assert self.first is not None
        return (self.count - 1) / max(self.last - self.first, 1e-9)


async def until(done: Callable[[], bool], budget: float = 600) -> None:
    deadline = time.monotonic() + budget
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark run did not finish")
        await asyncio.sleep(0.005)


async def plain_kafka(pool: asyncpg.Pool, topic: str) -> float:
    settings = load_settings()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=f"plain-{uuid.uuid4().hex}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    clock = Clock()
    try:
        while clock.count < N:
            batch = await consumer.getmany(timeout_ms=500, max_records=500)
            for tp, records in batch.items():
                async with pool.acquire() as conn, conn.transaction():
                    await record_payments([to_message(r) for r in records], conn)
                await consumer.commit({tp: records[-1].offset + 1})
                clock.tick(len(records))
    finally:
        await consumer.stop()
    return clock.rate()


async def timed(runner: Any) -> float:
    """Run a runner until it has settled N messages; its rate from first to last."""
    clock = Clock()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    seen = 0

    def done() -> bool:
        nonlocal seen
        if runner.stats.processed > seen:
            clock.tick(runner.stats.processed - seen)
            seen = runner.stats.processed
        return seen >= N

    try:
        await until(done)
    finally:
        stop.set()
        await task
    return clock.rate()


async def idempotent_kafka(store: PostgresStore, topic: str, batch: bool) -> float:
    consumer = idempotent_consumer(
        store, scope=f"bench-{uuid.uuid4().hex[:6]}", key=header("idempotency-key"), batch=batch
    )(record_payments if batch else record_payment)
    runner = KafkaRunner(consumer, topics=[topic], group_id=f"idem-{uuid.uuid4().hex}")
    return await timed(runner)


async def plain_rabbit(pool: asyncpg.Pool, queue: str) -> float:
    connection = await aio_pika.connect(load_settings().amqp_url)
    clock = Clock()
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=32)
        q = await channel.get_queue(queue)

        async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await record_payment(amqp_message(message), conn)
            await message.ack()
            clock.tick()

        tag = await q.consume(handle)
        await until(lambda: clock.count >= N)
        await q.cancel(tag)
    finally:
        await connection.close()
    return clock.rate()


async def idempotent_rabbit(store: PostgresStore, queue: str) -> float:
    consumer = idempotent_consumer(
        store, scope=f"bench-{uuid.uuid4().hex[:6]}", key=header("idempotency-key")
    )(record_payment)
    runner = RabbitRunner(consumer, queue=queue, prefetch=32)
    return await timed(runner)


async def run() -> list[dict[str, Any]]:
    settings = load_settings()
    results: list[dict[str, Any]] = []
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        await store.migrate()

        run_id = uuid.uuid4().hex[:8]
        topic = f"bench-payments-{run_id}"
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(topic, 1, 1)])
        messages = plan(N, 0.0, 1, run_id)
        await send_kafka(messages, topic)
        # plain and batch runs take seconds: alternate them (3 each) and take the medians, so
        # both see the same machine; the one-per-transaction run takes ~25 s and runs once
        plains: list[float] = []
        batches: list[float] = []
        for _ in range(3):
            plains.append(await plain_kafka(pool, topic))
            batches.append(await idempotent_kafka(store, topic, batch=True))
        plain, batched = statistics.median(plains), statistics.median(batches)
        one = await idempotent_kafka(store, topic, batch=False)
        await admin.delete_topics([topic])
        await admin.close()
        results += [
            entry("kafka.plain_batch_commit.msgs_per_s", plain, "msg/s", None),
            entry("kafka.idempotent.one_per_transaction.msgs_per_s", one, "msg/s", plain),
            entry("kafka.idempotent.batch_mode.msgs_per_s", batched, "msg/s", plain),
        ]

        rates: list[float] = []
        for which in ("plain", "idempotent"):
            queue = f"bench-{which}-{run_id}"
            await send_rabbit(plan(N, 0.0, 2, f"{run_id}{which}"), queue)
            rates.append(
                await (
                    plain_rabbit(pool, queue)
                    if which == "plain"
                    else idempotent_rabbit(store, queue)
                )
            )
            await _delete_queues(queue)
        results += [
            entry("rabbit.plain.msgs_per_s", rates[0], "msg/s", None),
            entry("rabbit.idempotent.msgs_per_s", rates[1], "msg/s", rates[0]),
        ]
        await pool.close()
    return results


async def _delete_queues(queue: str) -> None:
    connection = await aio_pika.connect(load_settings().amqp_url)
    try:
        channel = await connection.channel()
        for name in (queue, f"{queue}.dlq"):
            await channel.queue_delete(name)
    finally:
        await connection.close()
