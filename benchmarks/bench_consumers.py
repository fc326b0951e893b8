"""Consumers on a pre-filled topic / queue, each running the demo effect (one ledger row + the
account balance), measured in one run against plain baselines doing the same effect:

Kafka, one partition (20,000 messages; "per partition" is the figure itself):
  (a) a plain aiokafka consumer: per fetched batch, the same set-based effect in one transaction,
      then one offset commit; no idempotency.
  (b) ``@idempotent_consumer``, one message per transaction (two statements per message).
  (c) ``@idempotent_consumer`` in batch mode (one transaction per fetched batch), and the same
      with ``offsets_in_postgres=True`` (the offset upserted in each batch's COMMIT).
Kafka, eight partitions, one message per transaction: a plain aiokafka consumer with one worker
per partition (all eight at once, like the runner) and an offset commit per 50 records, against
``KafkaRunner``.
FastStream on Kafka, one partition: the same subscriber (``AckPolicy.MANUAL``, the effect in a
transaction, then the ack) with and without the ``Idempotency`` middleware; and the same for a
batch subscriber (``batch=True``: the set-based effect per delivered batch, then the commit).
Kafka, horizontally: 1, 2 and 4 consumer processes of one group over eight partitions, batch
mode (``benchmarks/kafka_scale.py``), with where the CPU went.
RabbitMQ: plain aio-pika (prefetch 32, effect in a transaction, ack) vs. the decorator.

Rates run from the first settled message to the last, so joining the group is not counted.
Each run reads the topic with a new consumer group and, for the decorator, a new scope; a
baseline and its subject alternate so both see the same machine, medians: one-partition batches
five rounds after a warm-up run of each, each round starting with another of the three; eight
partitions nine rounds after a warm-up run of each; FastStream per message three rounds, batch
subscribers five after a warm-up run of each.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aio_pika
import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks import kafka_scale
from benchmarks.common import Clock, entry, scratch_database, settle, settled_rate, until
from benchmarks.pg_cpu import CpuMeter, postmaster_of
from consumer_idem import PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.kafka import KafkaRunner, to_message
from consumer_idem.transports.rabbit import RabbitRunner
from consumer_idem.transports.rabbit import to_message as amqp_message
from examples.payments_producer import plan, send_kafka, send_rabbit
from handlers.payments import ensure_tables, record_payment, record_payments

N = 20_000
#: one message per transaction on one partition runs at commit speed: a bounded count
ONE_BY_ONE = 5_000
#: eight partitions, one message per transaction (per run; a warm-up and nine runs each side)
P8 = 8_000
#: FastStream, per message, a Kafka commit each (~6 ms on this broker; per run, three runs
#: each side)
FS_COUNT = 1_000


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


async def timed(runner: Any, count: int = N) -> float:
    """Run a runner until it has settled ``count`` messages; its rate from first to last."""
    clock = Clock()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    seen = 0

    def done() -> bool:
        nonlocal seen
        if runner.stats.processed > seen:
            clock.tick(runner.stats.processed - seen)
            seen = runner.stats.processed
        return seen >= count

    try:
        await until(done)
    finally:
        stop.set()
        await task
    return clock.rate()


async def idempotent_kafka(
    store: PostgresStore,
    topic: str,
    batch: bool,
    count: int = N,
    offsets_in_postgres: bool = False,
) -> float:
    consumer = idempotent_consumer(
        store, scope=f"bench-{uuid.uuid4().hex[:6]}", key=header("idempotency-key"), batch=batch
    )(record_payments if batch else record_payment)
    runner = KafkaRunner(
        consumer,
        topics=[topic],
        group_id=f"idem-{uuid.uuid4().hex}",
        offsets_in_postgres=offsets_in_postgres,
        outbox_relay=None,
    )
    return await timed(runner, count)


async def plain_unit(conn: asyncpg.Connection, record: Any) -> None:
    """The plain consumer's unit: the demo effect, in a transaction of its own."""
    async with conn.transaction():
        await record_payment(to_message(record), conn)


async def plain_kafka_per_partition(
    pool: asyncpg.Pool,
    topic: str,
    count: int,
    unit: Callable[[asyncpg.Connection, Any], Awaitable[None]] = plain_unit,
) -> float:
    """Plain aiokafka, one message per transaction, with the runner's concurrency: one worker
    per partition (all at once), an offset commit after every 50 records. ``unit``: what runs
    for each record (``benchmarks.p8_floor`` passes a hand-written idempotent one)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=load_settings().kafka_bootstrap,
        group_id=f"plain-{uuid.uuid4().hex}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    clock = Clock()
    queues: dict[TopicPartition, asyncio.Queue[list[Any]]] = {}
    workers: list[asyncio.Task[None]] = []

    async def work(tp: TopicPartition, queue: asyncio.Queue[list[Any]]) -> None:
        while True:
            records = await queue.get()
            async with pool.acquire() as conn:  # one connection per chunk, like the runner
                for record in records:
                    await unit(conn, record)
                    clock.tick()
            await consumer.commit({tp: records[-1].offset + 1})

    try:
        while clock.count < count:
            fetched = await consumer.getmany(timeout_ms=100, max_records=500)
            for tp, records in fetched.items():
                if tp not in queues:
                    queues[tp] = asyncio.Queue()
                    workers.append(asyncio.create_task(work(tp, queues[tp])))
                for i in range(0, len(records), 50):
                    queues[tp].put_nowait(records[i : i + 50])
                if queues[tp].qsize() >= 20:  # backpressure, as the runner pauses
                    consumer.pause(tp)
            for tp, queue in queues.items():
                if queue.qsize() < 10 and tp in consumer.paused():
                    consumer.resume(tp)
            if not fetched:
                await asyncio.sleep(0.005)
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await consumer.stop()
    return clock.rate()


def _faststream(store: PostgresStore, idempotent: bool) -> tuple[Any, Any, Any]:
    """A KafkaBroker and a router for one run, the router behind the middleware (returned
    too, for its stats) when ``idempotent``."""
    from faststream.kafka import KafkaBroker, KafkaRouter

    from consumer_idem.faststream import Idempotency

    broker = KafkaBroker(
        load_settings().kafka_bootstrap, acks="all", enable_idempotence=True, logger=None
    )
    if not idempotent:
        return broker, KafkaRouter(), None
    idem = Idempotency(
        store, broker=broker, scope=f"fs-{uuid.uuid4().hex[:6]}", key=header("idempotency-key")
    )
    return broker, KafkaRouter(middlewares=[idem]), idem


async def faststream_kafka(
    pool: asyncpg.Pool,
    store: PostgresStore,
    topic: str,
    idempotent: bool,
    count: int,
    make: Callable[[PostgresStore, bool], tuple[Any, Any, Any]] = _faststream,
    view: Callable[[Any], Any] = to_message,
) -> float:
    """One FastStream subscriber (``AckPolicy.MANUAL``), with or without the middleware: the
    effect in a transaction, then the ack (a commit of the partition's offset, per message).
    ``make``: the broker, router and middleware (aiokafka's broker by default); ``view``: the
    plain handler's ``ConsumerMessage`` of a record."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaMessage

    from consumer_idem.faststream import CurrentIdempotency

    broker, router, idem = make(store, idempotent)
    clock = Clock()
    options: dict[str, Any] = {
        "group_id": f"fs-{uuid.uuid4().hex}",
        "ack_policy": AckPolicy.MANUAL,
        "auto_offset_reset": "earliest",
    }
    if idem is not None:

        @router.subscriber(topic, **options)
        async def idempotent_handler(body: dict[str, Any], current: CurrentIdempotency) -> None:
            assert current.conn is not None
            await record_payment(current.message, current.conn)

    else:

        @router.subscriber(topic, **options)
        async def plain_handler(body: dict[str, Any], message: KafkaMessage) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await record_payment(view(message.raw_message), conn)
            await message.ack()
            clock.tick()

    return await settled_rate(broker, router, clock, idem, count)


async def faststream_kafka_batch(
    pool: asyncpg.Pool,
    store: PostgresStore,
    topic: str,
    idempotent: bool,
    count: int = N,
    make: Callable[[PostgresStore, bool], tuple[Any, Any, Any]] = _faststream,
    view: Callable[[Any], Any] = to_message,
) -> float:
    """One FastStream batch subscriber (``batch=True``, ``AckPolicy.MANUAL``, up to 500 records
    a batch), with or without the middleware: the set-based effect for the batch in
    one transaction, then the commit of the offsets; over the first ``count`` records
    (``make``, ``view``: as for `faststream_kafka`)."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaMessage

    from consumer_idem.faststream import CurrentIdempotencyBatch

    broker, router, idem = make(store, idempotent)
    clock = Clock()
    options: dict[str, Any] = {
        "group_id": f"fsb-{uuid.uuid4().hex}",
        "batch": True,
        "max_records": 500,  # the batch size of the other batch entries (KafkaRunner's default)
        "ack_policy": AckPolicy.MANUAL,
        "auto_offset_reset": "earliest",
    }
    if idem is not None:

        @router.subscriber(topic, **options)
        async def idempotent_handler(
            bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch
        ) -> None:
            await record_payments(current.messages, current.conn)

    else:

        @router.subscriber(topic, **options)
        async def plain_handler(bodies: list[dict[str, Any]], message: KafkaMessage) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await record_payments([view(r) for r in message.raw_message], conn)
            await message.ack()
            clock.tick(len(bodies))

    return await settled_rate(broker, router, clock, idem, count)


async def rotated(rounds: int, sides: Sequence[Callable[[], Any]]) -> list[list[float]]:
    """Each side once a round, each round starting with the next side (none always runs
    first, on a machine still busy with the one before); every side's rates, in order."""
    rates: list[list[float]] = [[] for _ in sides]
    for r in range(rounds):
        for k in range(len(sides)):
            i = (r + k) % len(sides)
            rates[i].append(await sides[i]())
    return rates


async def alternate(
    rounds: int, baseline: Callable[[], Any], subject: Callable[[], Any]
) -> tuple[float, float, list[float]]:
    """Baseline and subject alternately (the first of a round alternates too); their median
    rates and the ratio of each round, for the log."""
    base, subj = await rotated(rounds, [baseline, subject])
    ratios = [round(s / b, 2) for s, b in zip(subj, base, strict=True)]
    return statistics.median(base), statistics.median(subj), ratios


async def p8_entries(
    dsn: str, pool: asyncpg.Pool, store: PostgresStore, topic: str, rounds: int = 9
) -> list[dict[str, Any]]:
    """Eight partitions, one message per transaction: the rates, and the CPU per message of
    each round (this process's and the server's)."""
    # one run of each first, not counted: the first reads of a new topic cost more, and
    # single rounds here ranged from 0.56 to 1.22 (0.64 to 1.12 in one run of five): nine
    # rounds, medians
    await plain_kafka_per_partition(pool, topic, P8)
    await idempotent_kafka(store, topic, batch=False, count=P8)
    meter = CpuMeter(await postmaster_of(dsn))
    cpu: dict[str, list[float]] = {"plain": [], "idempotent": []}

    async def metered(side: str, run: Callable[[], Awaitable[float]]) -> float:
        meter.start()
        rate = await run()
        meter.stop(P8)
        cpu[side].append(meter.pg_us + meter.client_us)
        return rate

    base, subject, ratios = await alternate(
        rounds,
        lambda: metered("plain", lambda: plain_kafka_per_partition(pool, topic, P8)),
        lambda: metered("idempotent", lambda: idempotent_kafka(store, topic, False, P8)),
    )
    print(f"   p8 ratios per round: {ratios}; cpu per message: {cpu}", flush=True)
    return [
        entry("kafka.plain.one_per_transaction.p8", base, "msg/s", None),
        entry("kafka.idempotent.one_per_transaction.p8", subject, "msg/s", base),
        entry(
            "consumer.cpu_per_message.kafka.p8",
            statistics.median(cpu["idempotent"]),
            "us/msg",
            statistics.median(cpu["plain"]),
        ),
    ]


async def kafka_entries(
    dsn: str, pool: asyncpg.Pool, store: PostgresStore, run_id: str
) -> list[dict[str, Any]]:
    settings = load_settings()
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    one, eight = f"bench-payments-{run_id}", f"bench-payments-p8-{run_id}"
    await admin.create_topics([NewTopic(one, 1, 1), NewTopic(eight, 8, 1)])
    results: list[dict[str, Any]] = []
    try:
        await send_kafka(plan(N, 0.0, 1, run_id), one)
        # single partition, batches: plain, idempotent, idempotent with offsets in Postgres.
        # Each run lasts a second or two: one run of each first, not counted (the first reads
        # of a new topic cost more), then five rounds, each starting with the next; medians
        sides: list[Callable[[], Any]] = [
            lambda: plain_kafka(pool, one),
            lambda: idempotent_kafka(store, one, batch=True),
            lambda: idempotent_kafka(store, one, True, offsets_in_postgres=True),
        ]
        for run in sides:
            await run()
        plains, batches, in_pg = await rotated(5, sides)
        plain, batched, batched_pg = (statistics.median(v) for v in (plains, batches, in_pg))
        print(f"   batch rounds: plain {plains}, idempotent {batches}, in pg {in_pg}", flush=True)
        # one message per transaction on one partition: bounded (it runs at commit speed)
        one_by_one = await idempotent_kafka(store, one, batch=False, count=ONE_BY_ONE)
        results += [
            entry("kafka.plain_batch_commit.msgs_per_s", plain, "msg/s", None),
            entry("kafka.idempotent.one_per_transaction.msgs_per_s", one_by_one, "msg/s", plain),
            entry("kafka.idempotent.batch_mode.msgs_per_s", batched, "msg/s", plain),
            entry("kafka.idempotent.offsets_in_postgres.batch_mode", batched_pg, "msg/s", plain),
        ]

        # eight partitions, one message per transaction, all partitions at once; first the
        # machine settles (autovacuum and checkpoints after the batch runs' 60,000 rows)
        await send_kafka(plan(P8, 0.0, 2, run_id), eight)
        await settle()
        results += await p8_entries(dsn, pool, store, eight)

        # FastStream, one partition, per message (the first FS_COUNT records of the topic)
        base, subject, ratios = await alternate(
            3,
            lambda: faststream_kafka(pool, store, one, False, FS_COUNT),
            lambda: faststream_kafka(pool, store, one, True, FS_COUNT),
        )
        print(f"   faststream ratios per round: {ratios}", flush=True)
        results += [
            entry("faststream.kafka.plain", base, "msg/s", None),
            entry("faststream.kafka.idempotent", subject, "msg/s", base),
        ]
        # FastStream batch subscribers, one partition, the whole topic. Each run lasts a
        # second or two, so a checkpoint or an autovacuum of the runs before lands in one
        # round: the machine settles first, one run of each is not counted, five rounds
        await settle()
        await faststream_kafka_batch(pool, store, one, False)
        await faststream_kafka_batch(pool, store, one, True)
        base, subject, ratios = await alternate(
            5,
            lambda: faststream_kafka_batch(pool, store, one, False),
            lambda: faststream_kafka_batch(pool, store, one, True),
        )
        print(f"   faststream batch ratios per round: {ratios}", flush=True)
        results += [
            entry("faststream.kafka.plain.batch", base, "msg/s", None),
            entry("faststream.kafka.idempotent.batch", subject, "msg/s", base),
        ]
    finally:
        await admin.delete_topics([one, eight])
        await admin.close()
    results += await kafka_scale.run(dsn, run_id)
    return results


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
    results: list[dict[str, Any]] = []
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        await store.migrate()

        run_id = uuid.uuid4().hex[:8]
        results += await kafka_entries(dsn, pool, store, run_id)

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
