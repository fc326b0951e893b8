"""`@idempotent_consumer` on Kafka, runner in-process, against the real broker and database."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    Status,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from examples.payments_producer import plan, send_kafka
from handlers.payments import record_payment, record_payments
from tests._payments import (
    assert_exactly_once,
    ledger_count,
    payment,
    read_topic,
    send_raw,
    wait_until,
)

FAST = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


def ledger_consumer(store: PostgresStore, scope: str, batch: bool = False) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=batch, backoff=(0.1, 1.0)
    )(record_payments if batch else record_payment)


async def run_until(
    runner: KafkaRunner, done: Callable[[], Awaitable[bool]], within: float = 60
) -> KafkaRunner:
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await wait_until(done, within, "the runner to finish")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=60)
    return runner


async def committed(settings: Settings, group: str, topic: str, partition: int = 0) -> int | None:
    probe = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, group_id=group, enable_auto_commit=False
    )
    await probe.start()
    try:
        value: int | None = await probe.committed(TopicPartition(topic, partition))
        return value
    finally:
        await probe.stop()


@pytest.fixture
def run_id() -> str:
    return f"k{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch"])
async def test_producer_duplicates_and_redelivery_are_absorbed(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
    scope: str,
    batch: bool,
) -> None:
    topic = await kafka_topic_factory("pay", partitions=4)
    messages = plan(300, 0.3, 5, run_id)
    await send_kafka(messages, topic)
    consumer = ledger_consumer(store, scope, batch)

    async def all_booked() -> bool:
        return await ledger_count(pg_pool, run_id) >= 300

    first = KafkaRunner(consumer, topics=[topic], group_id=f"{run_id}-a", consumer_options=FAST)
    await run_until(first, all_booked)
    assert first.stats.processed == len(messages) == 390
    assert first.stats.executed == 300 and first.stats.duplicates == 90
    await assert_exactly_once(pg_pool, run_id, messages)

    # Redelivery: a second group re-reads the whole topic. Every delivery is a duplicate now.
    second = KafkaRunner(consumer, topics=[topic], group_id=f"{run_id}-b", consumer_options=FAST)

    async def reread() -> bool:
        return second.stats.processed >= len(messages)

    await run_until(second, reread)
    assert second.stats.executed == 0 and second.stats.duplicates == 390
    await assert_exactly_once(pg_pool, run_id, messages)


async def test_bad_input_is_dead_lettered_with_reasons_and_loses_nothing(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("bad", partitions=1)
    key = b"good-1"
    await send_raw(
        kafka_producer,
        topic,
        [
            ({"idempotency-key": b"\xff\xfe\xfd"}, payment(run_id, 1)),
            ({"idempotency-key": b"k" * 10_240}, payment(run_id, 2)),
            ({}, payment(run_id, 3)),
            ({"idempotency-key": b"json-1"}, b"{not json"),
            ({"idempotency-key": key}, payment(run_id, 4)),
            ({"idempotency-key": key}, payment(run_id, 4, amount=999)),  # same key, other body
            ({"idempotency-key": b"fields-1"}, b'{"payment_id": "x"}'),
            ({"idempotency-key": b"good-2"}, payment(run_id, 5)),
        ],
    )
    runner = KafkaRunner(
        ledger_consumer(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST
    )

    async def all_settled() -> bool:
        return runner.stats.processed >= 8

    await run_until(runner, all_settled)
    dead = await read_topic(settings.kafka_bootstrap, f"{topic}.dlq", 6)
    reasons = [dict(r.headers)["x-dead-letter-reason"].decode() for r in dead]
    assert reasons == [
        "invalid_key:invalid_utf8",
        "invalid_key:too_long",
        "invalid_key:missing_key",
        "invalid_json",
        "key_misuse",
        "invalid_payment",
    ]
    offsets = [int(dict(r.headers)["x-original-offset"]) for r in dead]
    assert offsets == [0, 1, 2, 3, 5, 6]
    assert all(dict(r.headers)["x-original-topic"] == topic.encode() for r in dead)
    assert await ledger_count(pg_pool, run_id) == 2  # the two good payments, once each
    assert await committed(settings, run_id, topic) == 8


async def test_ambiguous_failure_parks_unknown_and_notifies_before_commit(
    settings: Settings,
    store: PostgresStore,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("amb", partitions=1)
    reconcile = f"{topic}.reconcile"

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raise Ambiguous("gateway read timeout after the request was sent")

    await send_raw(kafka_producer, topic, [({"idempotency-key": b"pay-1"}, b'{"amount": 5}')])
    runner = KafkaRunner(
        charge, topics=[topic], group_id=run_id, reconcile_topic=reconcile, consumer_options=FAST
    )

    async def settled() -> bool:
        return runner.stats.processed >= 1

    await run_until(runner, settled)
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_published_at is not None
    notices = await read_topic(settings.kafka_bootstrap, reconcile, 1)
    assert len(notices) == 1
    assert dict(notices[0].headers)["x-consumer-idem-key"] == b"pay-1"
    assert runner.stats.reconcile_published == 1
    assert await committed(settings, run_id, topic) == 1


async def test_store_outage_means_no_commit_until_it_returns(
    settings: Settings,
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    from tests._broker import Outage

    outage = await Outage.start(store, pg_dsn)  # the database is unreachable until end()
    topic = await kafka_topic_factory("outage", partitions=1)
    await send_raw(
        kafka_producer,
        topic,
        [({"idempotency-key": f"o-{i}".encode()}, payment(run_id, i)) for i in range(5)],
    )
    runner = KafkaRunner(
        ledger_consumer(outage.down, scope), topics=[topic], group_id=run_id, consumer_options=FAST
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await wait_until(lambda: _gt(runner.stats, "retries", 2), 30, "retries while down")
        assert await ledger_count(pg_pool, run_id) == 0
        assert runner.stats.commits == 0
        outage.end()  # the store is back

        async def resumed() -> bool:
            return runner.stats.processed >= 5

        await wait_until(resumed, 30, "processing to resume")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert await ledger_count(pg_pool, run_id) == 5
    assert await committed(settings, run_id, topic) == 5


async def _gt(stats: Any, field: str, value: int) -> bool:
    return bool(getattr(stats, field) > value)


async def test_batch_mode_falls_back_one_by_one_around_a_poison_member(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("batch", partitions=1)
    items = [({"idempotency-key": f"b-{i}".encode()}, payment(run_id, i)) for i in range(20)]
    items[7] = ({"idempotency-key": b"b-7"}, b'{"payment_id": "missing the rest"}')
    items.append(({"idempotency-key": b"b-3"}, payment(run_id, 3)))  # a duplicate in the batch
    await send_raw(kafka_producer, topic, items)
    runner = KafkaRunner(
        ledger_consumer(store, scope, batch=True),
        topics=[topic],
        group_id=run_id,
        consumer_options=FAST,
    )

    async def settled() -> bool:
        return runner.stats.processed >= 21

    await run_until(runner, settled)
    assert await ledger_count(pg_pool, run_id) == 19
    assert runner.stats.dead_lettered == 1 and runner.stats.duplicates == 1
    dead = await read_topic(settings.kafka_bootstrap, f"{topic}.dlq", 1)
    assert dict(dead[0].headers)["x-dead-letter-reason"] == b"invalid_payment"


async def test_a_key_in_progress_elsewhere_holds_only_its_own_partition(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("held", partitions=2)
    held_body = payment(run_id, 0)
    from consumer_idem import fingerprint_payload

    holder = await store.reserve(scope, "held", fingerprint_payload(held_body), lease=60)
    await send_raw(kafka_producer, topic, [({"idempotency-key": b"held"}, held_body)], partition=0)
    await send_raw(
        kafka_producer,
        topic,
        [({"idempotency-key": f"free-{i}".encode()}, payment(run_id, 100 + i)) for i in range(10)],
        partition=1,
    )
    runner = KafkaRunner(
        ledger_consumer(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def others_done() -> bool:
            return await ledger_count(pg_pool, run_id) >= 10

        await wait_until(others_done, 30, "partition 1 to be processed")
        assert runner.stats.retries >= 1  # partition 0 is waiting on the held key
        # the other owner finishes: its effect is the one that counts
        async with pg_pool.acquire() as conn, conn.transaction():
            await record_payment(ConsumerMessage(held_body), conn)
            await store.complete(scope, "held", holder.token, None, conn=conn)

        async def all_settled() -> bool:
            return runner.stats.processed >= 11

        await wait_until(all_settled, 30, "the held key to be replayed")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert runner.stats.duplicates == 1
    assert await ledger_count(pg_pool, run_id) == 11


@pytest.fixture(autouse=True)
async def _no_leftover_tasks() -> AsyncIterator[None]:
    yield
    await asyncio.sleep(0)
