"""The FastStream middleware on the real brokers: duplicates, poison, retries, explicit Kafka
commits, and the example app SIGKILLed mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import uuid
from collections import defaultdict
from typing import Any

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.rabbit import QueueType, RabbitBroker, RabbitQueue, RabbitRouter

from consumer_idem import Ambiguous, PostgresStore, Status, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection
from consumer_idem.notice import decode_notice
from consumer_idem.transports.kafka import to_message
from examples.payments_producer import plan, send_kafka, send_rabbit
from handlers.payments import ensure_tables
from tests._faststream import effect_count, write_effect
from tests._payments import assert_exactly_once, ledger_count, read_topic, wait_until
from tests.conftest import ROOT_DIR, unique

KEY = header("idempotency-key")


AMBIGUOUS = ("amb", b'{"n": 99, "fail_once": false, "ambiguous": true}')


def planned(keys: int, duplicated: int) -> list[tuple[str, bytes]]:
    """(key, body) for ``keys`` keys, the first ``duplicated`` of them sent twice, mixed, and
    one whose handler fails ambiguously (parked ``unknown``, a notice published)."""
    items = [
        (f"k{i}", json.dumps({"n": i, "fail_once": i == keys - 1}).encode()) for i in range(keys)
    ]
    items += [*items[:duplicated], AMBIGUOUS]
    random.Random(keys).shuffle(items)
    return items


def middleware(store: PostgresStore, broker: Any, scope: str, notices: str) -> Idempotency:
    """The middleware both real-broker tests use: short backoffs, their own notice topic."""
    return Idempotency(
        store,
        broker=broker,
        scope=scope,
        key=KEY,
        backoff=(0.05, 0.5),
        reconcile_destination=notices,
    )


def failing_once(failed: set[str]) -> Any:
    """A handler whose message marked ``fail_once`` fails on its first attempt (the effect
    rolls back, the delivery is handed back and runs again); it returns a timestamped result,
    so a replay that ran the handler again would publish other bytes."""

    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> dict[str, Any]:
        await write_effect(conn, current, data["n"])
        if data.get("ambiguous"):
            raise Ambiguous("the far side timed out")
        if data["fail_once"] and current.key not in failed:
            failed.add(current.key)
            raise ConnectionError("first attempt fails")
        at = await conn.fetchval("SELECT clock_timestamp()::text")
        return {"key": current.key, "n": data["n"], "at": at}

    return handle


async def assert_parked(store: PostgresStore, scope: str) -> None:
    record = await store.get(scope, AMBIGUOUS[0])
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_published_at is not None  # published before the delivery settled


def by_key(bodies: list[bytes]) -> dict[str, set[bytes]]:
    grouped: dict[str, set[bytes]] = defaultdict(set)
    for body in bodies:
        grouped[json.loads(body)["key"]].add(body)
    return grouped


async def test_kafka_duplicates_poison_and_a_retry_with_explicit_per_partition_commits(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = await kafka_topic_factory("fs", partitions=2)
    results = await kafka_topic_factory("fsout")
    notices = await kafka_topic_factory("fsrec")
    await kafka_admin.create_topics([NewTopic(f"{topic}.dlq", 1, 1)])
    group = unique("fsg")
    commits: list[Any] = []
    original_commit = AIOKafkaConsumer.commit

    async def spy(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        commits.append(offsets)
        await original_commit(self, offsets)

    monkeypatch.setattr(AIOKafkaConsumer, "commit", spy)

    broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    idem = middleware(store, broker, scope, notices)
    router = KafkaRouter(middlewares=[idem])
    failed: set[str] = set()

    subscribe = router.subscriber(
        topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    subscribe(router.publisher(results)(failing_once(failed)))

    broker.include_router(router)
    items = planned(20, 10)
    for i, (key, body) in enumerate(items):
        await kafka_producer.send_and_wait(
            topic, body, partition=i % 2, headers=[("idempotency-key", key.encode())]
        )
    await kafka_producer.send_and_wait(topic, b'{"n": -1}', partition=0)  # no key: poison
    await broker.start()
    try:

        async def all_done() -> bool:
            return idem.stats.processed >= len(items) + 1

        await wait_until(all_done, 60, "every record to be settled")
    finally:
        await broker.stop()

    assert await effect_count(pg_pool, scope) == 20
    assert failed == {"k19"}
    record = await store.get(scope, "k19")
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    out = await read_topic(settings.kafka_bootstrap, results, len(items) + 5, within=4)
    grouped = by_key([r.value for r in out])
    assert len(out) == 30 and len(grouped) == 20
    await assert_parked(store, scope)
    (notice,) = await read_topic(settings.kafka_bootstrap, notices, 1)
    assert decode_notice(to_message(notice)).key == "amb"
    assert all(len(bodies) == 1 for bodies in grouped.values()), "a replay published other bytes"
    dead = await read_topic(settings.kafka_bootstrap, f"{topic}.dlq", 1)
    assert (
        len(dead) == 1
        and dict(dead[0].headers)["x-dead-letter-reason"] == b"invalid_key:missing_key"
    )
    # every commit named one partition and the offset after the record it settled
    assert commits and all(isinstance(c, dict) and len(c) == 1 for c in commits)
    committed = await kafka_admin.list_consumer_group_offsets(group)
    ends = {0: 0, 1: 0}
    for i in range(len(items)):
        ends[i % 2] += 1
    ends[0] += 1
    assert {tp.partition: meta.offset for tp, meta in committed.items()} == ends
    assert (
        max(c[TopicPartition(topic, 0)] for c in commits if TopicPartition(topic, 0) in c)
        == ends[0]
    )
    await kafka_admin.delete_topics([f"{topic}.dlq"])


async def test_rabbitmq_duplicates_poison_and_a_retry(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    queue, results, notices = unique("fsq"), unique("fsout"), unique("fsrec")
    broker = RabbitBroker(settings.amqp_url)
    idem = middleware(store, broker, scope, notices)
    router = RabbitRouter(middlewares=[idem])
    failed: set[str] = set()

    subscribe = router.subscriber(
        RabbitQueue(queue, queue_type=QueueType.QUORUM), ack_policy=AckPolicy.MANUAL
    )
    subscribe(router.publisher(results, persist=True)(failing_once(failed)))

    broker.include_router(router)
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        out_queue = await channel.declare_queue(
            results, durable=True, arguments={"x-queue-type": "quorum"}
        )
        items = planned(20, 10)
        for key, body in items:
            await channel.default_exchange.publish(
                aio_pika.Message(body, headers={"idempotency-key": key}), routing_key=queue
            )
        await channel.default_exchange.publish(aio_pika.Message(b'{"n": -1}'), routing_key=queue)
        await broker.start()
        try:

            async def all_done() -> bool:
                return idem.stats.processed >= len(items) + 1

            await wait_until(all_done, 60, "every message to be settled")
        finally:
            await broker.stop()
        assert await effect_count(pg_pool, scope) == 20
        record = await store.get(scope, "k19")
        assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
        bodies = []
        while (message := await out_queue.get(fail=False, no_ack=True)) is not None:
            bodies.append(message.body)
        grouped = by_key(bodies)
        assert len(bodies) == 30 and len(grouped) == 20
        assert all(len(b) == 1 for b in grouped.values()), "a replay published other bytes"
        await assert_parked(store, scope)
        notice = await (await channel.declare_queue(notices, passive=True)).get(no_ack=True)
        assert json.loads(notice.body)["key"] == "amb"
        dlq = await channel.declare_queue(f"{queue}.dlq", passive=True)
        dead = await dlq.get(no_ack=True)
        assert dead.headers["x-dead-letter-reason"] == "invalid_key:missing_key"
        assert dead.headers["x-original-queue"] == queue
        source = await channel.declare_queue(queue, passive=True)
        assert source.declaration_result.message_count == 0
    finally:
        for name in (queue, results, notices, f"{queue}.dlq"):
            await channel.queue_delete(name)
        await channel.close()


# --- the example app, SIGKILLed -----------------------------------------------------------------


async def start_app(env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "faststream",
        "run",
        "examples.faststream_app:app",
        cwd=ROOT_DIR,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    while True:  # FastStream logs to stderr; wait until both brokers run
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=60)
        assert line, "the app exited before it started"
        if b"started successfully" in line:
            break
    task = asyncio.create_task(drain(proc))
    DRAINS.add(task)
    task.add_done_callback(DRAINS.discard)
    return proc


DRAINS: set[asyncio.Task[None]] = set()


async def drain(proc: asyncio.subprocess.Process) -> None:
    """Read the app's log so that it never blocks on a full pipe."""
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


async def test_the_example_app_sigkilled_mid_run_loses_and_doubles_nothing(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    kafka_admin: AIOKafkaAdminClient,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    await ensure_tables(pg_pool)
    name = unique("fsapp")
    kafka_run, rabbit_run = f"fk{uuid.uuid4().hex[:6]}", f"fr{uuid.uuid4().hex[:6]}"
    kafka_messages = plan(400, 0.2, 5, kafka_run)
    rabbit_messages = plan(400, 0.2, 6, rabbit_run)
    await send_kafka(kafka_messages, name)
    await send_rabbit(rabbit_messages, name)
    env = dict(
        os.environ,
        CONSUMER_IDEM_PG_DSN=pg_dsn,
        PAYMENTS_TOPIC=name,
        PAYMENTS_RESULTS=f"{name}.out",
        PAYMENTS_GROUP=name,
        PAYMENTS_INSTANCE_ID=f"{name}-1",
        PAYMENTS_PREFETCH="1",  # one at a time, so that the kills land mid-run on RabbitMQ too
        PAYMENTS_SLOW_MS="15",
    )
    rng = random.Random(name)
    channel = await amqp_connection.channel()
    try:
        for _ in range(5):
            proc = await start_app(env)
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        booked = [await ledger_count(pg_pool, run) for run in (kafka_run, rabbit_run)]
        assert all(0 < n < 400 for n in booked), f"the kills must land mid-run ({booked})"
        final = await start_app(env)

        async def all_booked() -> bool:
            return (
                await ledger_count(pg_pool, kafka_run) >= 400
                and await ledger_count(pg_pool, rabbit_run) >= 400
            )

        await wait_until(all_booked, 180, "the last run to finish")
        await asyncio.sleep(1.0)  # anything still arriving would be a double
        final.send_signal(signal.SIGTERM)
        await asyncio.wait_for(final.wait(), timeout=60)
        assert final.returncode == 0

        await assert_exactly_once(pg_pool, kafka_run, kafka_messages)
        await assert_exactly_once(pg_pool, rabbit_run, rabbit_messages)
        # confirmations: at least one per payment, and every copy of one is the same bytes
        out = await read_topic(settings.kafka_bootstrap, f"{name}.out", 10**9, within=5)
        results = await channel.declare_queue(f"{name}.out", passive=True)
        rabbit_out = []
        while (message := await results.get(fail=False, no_ack=True)) is not None:
            rabbit_out.append(message.body)
        for bodies, run in (
            ([r.value for r in out], kafka_messages),
            (rabbit_out, rabbit_messages),
        ):
            grouped: dict[str, set[bytes]] = defaultdict(set)
            for body in bodies:
                grouped[json.loads(body)["idempotency_key"]].add(body)
            assert set(grouped) == {m.key for m in run}
            assert all(len(copies) == 1 for copies in grouped.values())
    finally:
        for queue in (name, f"{name}.out", f"{name}.dlq"):
            await channel.queue_delete(queue)
        await channel.close()
        await kafka_admin.delete_topics([name, f"{name}.out"])


# --- faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_hold", [600.0, 0.3], ids=["held", "handed-back-as-copies"])
async def test_rabbitmq_store_outage_longer_than_the_delivery_budget_dead_letters_nothing(
    max_hold: float,
    settings: Settings,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    from tests._broker import Outage

    outage = await Outage.start(store, pg_dsn)
    queue = unique("fsout")
    broker = RabbitBroker(settings.amqp_url)
    idem = Idempotency(
        outage.down,
        broker=broker,
        scope=scope,
        key=KEY,
        backoff=(0.05, 0.2),
        max_deliveries=2,
        max_hold=max_hold,
    )
    router = RabbitRouter(middlewares=[idem])

    @router.subscriber(RabbitQueue(queue, queue_type=QueueType.QUORUM), ack_policy=AckPolicy.MANUAL)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        for name in (queue, f"{queue}.dlq"):
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}', headers={"idempotency-key": "k1"}), routing_key=queue
        )
        await broker.start()
        try:
            await asyncio.sleep(3)  # far more than 2 "retry later"s at a 0.05-0.2 s backoff
            assert idem.stats.retries >= 4 and idem.stats.dead_lettered == 0
            outage.end()

            async def ran() -> bool:
                return idem.stats.processed >= 1

            await wait_until(ran, 15, "the message to run once the store is back")
        finally:
            await broker.stop()
        assert idem.stats.dead_lettered == 0 and idem.stats.executed == 1
        assert await effect_count(pg_pool, scope) == 1
        for name in (queue, f"{queue}.dlq"):
            declared = await channel.declare_queue(name, passive=True)
            assert declared.declaration_result.message_count == 0
    finally:
        for name in (queue, f"{queue}.dlq"):
            await channel.queue_delete(name)
        await channel.close()


async def test_rabbitmq_a_dead_letter_no_queue_takes_leaves_the_delivery_unacked(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    """No dead-letter queue (``declare=False``): the broker returns the copy. Taking that for
    published would ack a message that is nowhere."""
    queue = unique("fsnodlq")
    broker = RabbitBroker(settings.amqp_url)
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY, declare=False)
    router = RabbitRouter(middlewares=[idem])

    @router.subscriber(RabbitQueue(queue, queue_type=QueueType.QUORUM), ack_policy=AckPolicy.MANUAL)
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("a message without a key must not run")

    broker.include_router(router)
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        await channel.default_exchange.publish(aio_pika.Message(b'{"n": 1}'), routing_key=queue)
        await broker.start()
        try:
            await asyncio.sleep(2)
            assert idem.stats.dead_lettered == 0 and idem.stats.processed == 0
        finally:
            await broker.stop()

        async def back() -> bool:
            declared = await channel.declare_queue(queue, passive=True)
            return declared.declaration_result.message_count == 1

        await wait_until(back, 10, "the message to be back in its queue")
    finally:
        await channel.queue_delete(queue)
        await channel.close()
