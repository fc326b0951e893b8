"""Reconciliation of unknown outcomes on real Kafka and Postgres."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import uuid
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    Executed,
    NotExecuted,
    PostgresStore,
    Status,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.errors import StoreRejected
from consumer_idem.operations.reconcile import Reconciler, StillUnknown, Sweeper
from consumer_idem.testing.broker import MemoryTransport
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.types import Record
from tests._payments import read_topic, send_raw, wait_until
from tests._runners import Running
from tests._workers import park_and_die

FAST = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


@pytest.fixture
async def flaky(store: PostgresStore, pg_pool: asyncpg.Pool, scope: str) -> Any:
    """A two-phase consumer whose external call times out the first time for each key."""
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS rec_effects (scope text, key text)")
    seen: set[str] = set()

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        if attempt.key not in seen:
            seen.add(attempt.key)
            raise Ambiguous("read timeout after sending")
        await pg_pool.execute("INSERT INTO rec_effects VALUES ($1, $2)", scope, attempt.key)
        return {"charged": attempt.key}

    return charge


async def effects(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM rec_effects WHERE scope = $1", scope))


async def park_one(
    flaky: Any,
    topic: str,
    reconcile: str,
    producer: AIOKafkaProducer,
    running: Running,
    key: bytes = b"pay-1",
) -> KafkaRunner:
    runner = running.start(
        KafkaRunner(
            flaky,
            topics=[topic],
            group_id=f"{topic}-g",
            reconcile_topic=reconcile,
            consumer_options=FAST,
        )
    )
    await send_raw(producer, topic, [({"idempotency-key": key}, b'{"amount": 7}')])

    async def parked() -> bool:
        return bool(runner.stats.reconcile_published >= 1)

    await wait_until(parked, 30, "the key to be parked and announced")
    return runner


def reconciler_on(
    store: PostgresStore, resolver: Any, reconcile: str, running: Running, **options: Any
) -> tuple[Reconciler, KafkaRunner]:
    reconciler = Reconciler(store, resolver, **options)
    # notices the sweeper re-sends go to the topic this reconciler consumes
    runner = KafkaRunner(
        reconciler,
        topics=[reconcile],
        group_id=f"{reconcile}-g",
        reconcile_topic=reconcile,
        dead_letter_topic=f"{reconcile}.operator",
        consumer_options=FAST,
    )
    reconciler.attach(runner)
    running.start(runner)
    return reconciler, runner


async def test_executed_answer_completes_and_a_duplicate_replays_it(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    flaky: Any,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    running: Running,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("rec")
    reconcile = f"{topic}.reconcile"
    consumer_runner = await park_one(flaky, topic, reconcile, kafka_producer, running)

    async def gateway_says_charged(record: Record) -> Any:
        return Executed({"charged": record.key, "source": "gateway"})

    reconciler_on(store, gateway_says_charged, reconcile, running)

    async def completed() -> bool:
        record = await store.get(scope, "pay-1")
        return record is not None and record.status is Status.COMPLETED

    await wait_until(completed, 30, "the record to be resolved")
    record = await store.get(scope, "pay-1")
    assert record is not None and record.result == {"charged": "pay-1", "source": "gateway"}
    await send_raw(kafka_producer, topic, [({"idempotency-key": b"pay-1"}, b'{"amount": 7}')])

    async def replayed() -> bool:
        return consumer_runner.stats.duplicates >= 1

    await wait_until(replayed, 30, "the duplicate to be replayed")
    assert await effects(pg_pool, scope) == 0  # never executed a second time


async def test_not_executed_answer_redispatches_and_it_runs_exactly_once(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    flaky: Any,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    running: Running,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("rec")
    reconcile = f"{topic}.reconcile"
    await park_one(flaky, topic, reconcile, kafka_producer, running)

    async def gateway_has_no_charge(record: Record) -> Any:
        return NotExecuted("gateway: no charge for that key")

    reconciler_on(store, gateway_has_no_charge, reconcile, running)

    async def ran() -> bool:
        return await effects(pg_pool, scope) >= 1

    await wait_until(ran, 30, "the re-dispatched message to run")
    await asyncio.sleep(1.0)
    assert await effects(pg_pool, scope) == 1
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2


async def test_still_unknown_backs_off_then_goes_to_the_operator(
    settings: Settings,
    store: PostgresStore,
    flaky: Any,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    running: Running,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("rec")
    reconcile = f"{topic}.reconcile"
    await park_one(flaky, topic, reconcile, kafka_producer, running)
    asked = 0

    async def cannot_tell(record: Record) -> Any:
        nonlocal asked
        asked += 1
        return StillUnknown("gateway lookup timed out")

    _, runner = reconciler_on(
        store,
        cannot_tell,
        reconcile,
        running,
        max_attempts=3,
        backoff=(0.3, 0.6),
        scopes=[scope],
    )
    sweeping = asyncio.Event()
    sweeper = asyncio.create_task(
        Sweeper(store, runner, scopes=[scope]).run(sweeping, interval=0.2)
    )
    try:

        async def with_operator() -> bool:
            return runner.stats.dead_lettered >= 1

        await wait_until(with_operator, 60, "the case to reach the operator")
    finally:
        sweeping.set()
        await sweeper
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_attempts == 3 and asked == 3
    assert record.reconcile_after is None and (record.last_error or "").startswith("operator:")
    assert store.metrics.count("reconcile_scheduled", scope) == 2
    operator = await read_topic(settings.kafka_bootstrap, f"{reconcile}.operator", 1)
    assert json.loads(operator[0].value)["key"] == "pay-1"
    assert dict(operator[0].headers)["x-dead-letter-reason"] == b"reconcile_exhausted"


async def test_a_crash_between_parking_and_publishing_is_caught_by_the_sweeper(
    settings: Settings,
    pg_dsn: str,
    store: PostgresStore,
    kafka_topic_factory: Any,
    running: Running,
    scope: str,
) -> None:
    key = f"crash-{uuid.uuid4().hex[:6]}"
    child = multiprocessing.get_context("spawn").Process(
        target=park_and_die, args=(pg_dsn, scope, key)
    )
    child.start()
    await asyncio.get_running_loop().run_in_executor(None, child.join, 60)
    assert child.exitcode == -9
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_published_at is None  # nobody announced it

    reconcile = f"{await kafka_topic_factory('rec')}.reconcile"

    async def unused(record: Record) -> Any:
        return StillUnknown()

    _, runner = reconciler_on(store, unused, reconcile, running)

    async def started() -> bool:
        return bool(runner._started)

    await wait_until(started, 30, "the reconciler's runner to start")
    report = await Sweeper(store, runner, scopes=[scope]).run_once()
    assert report.published == 1
    notices = await read_topic(settings.kafka_bootstrap, reconcile, report.published)
    assert key.encode() in [dict(n.headers)["x-consumer-idem-key"] for n in notices]
    record = await store.get(scope, key)
    assert record is not None and record.reconcile_published_at is not None
    assert all(r.key != key for r in await store.reconciliation.due_notices(1000))


async def test_rabbit_not_executed_redispatches_to_the_source_queue(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    flaky: Any,
    running: Running,
    scope: str,
) -> None:
    import aio_pika

    from consumer_idem.transports.rabbit import RabbitRunner

    queue = f"rq-{uuid.uuid4().hex[:8]}"
    reconcile = f"{queue}.reconcile"
    running.start(RabbitRunner(flaky, queue=queue, reconcile_queue=reconcile))

    async def no_charge(record: Record) -> Any:
        return NotExecuted("gateway: no charge for that key")

    reconciler = Reconciler(store, no_charge)
    rec_runner = RabbitRunner(
        reconciler,
        queue=reconcile,
        reconcile_queue=reconcile,
        dead_letter_queue=f"{reconcile}.operator",
    )
    reconciler.attach(rec_runner)
    running.start(rec_runner)
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"amount": 3}', headers={"idempotency-key": "pay-r"}),
            routing_key=queue,
        )

        async def ran() -> bool:
            return await effects(pg_pool, scope) >= 1

        await wait_until(ran, 30, "the re-dispatched message to run")
        await asyncio.sleep(1.0)
        assert await effects(pg_pool, scope) == 1
        record = await store.get(scope, "pay-r")
        assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    finally:
        await running.stop_all()
        running.tasks.clear()
        channel = await connection.channel()
        for name in (queue, f"{queue}.dlq", reconcile, f"{reconcile}.operator", f"{reconcile}.dlq"):
            await channel.queue_delete(name)
        await connection.close()


async def test_the_sweeper_outlives_a_pass_the_store_refused(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    """One sweep pass refused by the store (not an outage) is logged and tried again at the
    next interval: a sweeper that ended there would leave expired leases unparked until a
    restart."""
    await pg_pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, owner_token, locked_until,"
        " expires_at) VALUES ($1, 'zombie', 'v1:jcs:x', 'in_progress', gen_random_uuid(),"
        " now() - interval '1 second', now() + interval '1 day')",
        scope,
    )
    sweep = store.maintenance.sweep
    refused = 0

    async def refused_once(**kwargs: Any) -> Any:
        nonlocal refused
        if not refused:
            refused += 1
            raise StoreRejected("idempotency store sweep failed: refused once")
        return await sweep(**kwargs)

    store.maintenance.sweep = refused_once  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(
        Sweeper(store, MemoryTransport(store), scopes=[scope]).run(stop, interval=0.05)
    )
    try:

        async def parked() -> bool:
            record = await store.get(scope, "zombie")
            return record is not None and record.status is Status.UNKNOWN

        await wait_until(parked, 10, "the zombie to be parked on a later pass")
    finally:
        stop.set()
        del store.maintenance.sweep
        await asyncio.wait_for(task, 10)
    assert refused == 1
