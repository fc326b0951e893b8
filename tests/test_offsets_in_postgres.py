"""Kafka offsets kept in Postgres (``KafkaRunner(offsets_in_postgres=True)``), on the real broker
and database: a consumer SIGKILLed at every step of a unit of work, a rebalance between two
consumers while Kafka refuses their offset commits, a partition moving to a consumer that never
saw it, and a producer's retry (the same key at a new offset)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.kafka_offsets import PostgresOffsets
from examples.payments_producer import PlannedMessage, plan, send_kafka
from handlers.payments import record_payment, record_payments
from tests._payments import assert_exactly_once, ledger_count, payment, send_raw, wait_until
from tests.conftest import ROOT_DIR
from tests.test_consumer_kafka import FAST, committed
from tests.test_transport_kafka import RefusedDeadLetters

STEPS = ("fetched", "handler", "commit", "committed", "kafka")


@pytest.fixture
def run_id() -> str:
    return f"op{uuid.uuid4().hex[:8]}"


async def child(pg_dsn: str, *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._offsets_child",
        *args,
        cwd=ROOT_DIR,
        env=dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    assert line and json.loads(line)["event"] == "started", line
    return proc


async def stopped(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, proc.returncode
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def stored_offsets(store: PostgresStore, group: str, topic: str, n: int) -> dict[int, int]:
    found = await PostgresOffsets(store, group).load((topic, p) for p in range(n))
    return {p: offset for (_, p), (offset, _) in found.items()}


async def crash_then_restart(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    topic: str,
    run_id: str,
    messages: list[PlannedMessage],
    mode: str,
    step: str,
    offsets: str,
) -> tuple[int, dict[str, Any]]:
    """Run a consumer that SIGKILLs itself at ``step`` of its second unit of work, then one
    that finishes the topic; the ledger rows the first left, and the second one's stats."""
    args = [topic, run_id, f"scope-{run_id}", mode]
    killed = await child(pg_dsn, *args, step, "2", offsets)
    await asyncio.wait_for(killed.wait(), timeout=60)
    assert killed.returncode == -signal.SIGKILL
    left = await ledger_count(pg_pool, run_id)
    restarted = await child(pg_dsn, *args, "none", "0", offsets)
    try:

        async def finished() -> bool:
            return await ledger_count(pg_pool, run_id) >= len(messages)

        await wait_until(finished, 60, "the restarted consumer to finish the topic")
        await asyncio.sleep(0.5)  # a late duplicate would show in the stats now
    finally:
        stats = await stopped(restarted)
    return left, stats


@pytest.mark.parametrize("mode", ["one", "batch"])
@pytest.mark.parametrize("step", STEPS)
async def test_sigkill_at_every_step_never_hands_a_committed_record_back(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
    mode: str,
    step: str,
) -> None:
    """Whatever step the process dies at, the restarted consumer starts exactly after what
    Postgres committed: it meets no record again (no replay) and runs each of the others once."""
    topic = await kafka_topic_factory("offsets")
    messages = plan(30, 0.0, 1, run_id)
    await send_kafka(messages, topic)
    left, stats = await crash_then_restart(
        pg_dsn, pg_pool, topic, run_id, messages, mode, step, "on"
    )
    await assert_exactly_once(pg_pool, run_id, messages)
    assert stats["duplicates"] == 0, (step, left, stats)
    assert stats["executed"] == len(messages) - left, (step, left, stats)
    assert await stored_offsets(store, run_id, topic, 1) == {0: len(messages)}


async def test_without_offsets_in_postgres_the_same_crash_replays_a_committed_record(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
) -> None:
    """The contrast: killed between the Postgres commit and the Kafka commit, a consumer that
    keeps its offsets in Kafka only is handed the committed records again (the keys make them
    replays, so the effect is still once)."""
    topic = await kafka_topic_factory("offsets-kafka")
    messages = plan(30, 0.0, 2, run_id)
    await send_kafka(messages, topic)
    left, stats = await crash_then_restart(
        pg_dsn, pg_pool, topic, run_id, messages, "batch", "committed", "off"
    )
    await assert_exactly_once(pg_pool, run_id, messages)
    assert stats["duplicates"] >= 1, (left, stats)


def ledger(store: PostgresStore, scope: str, batch: bool = False) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=batch, backoff=(0.1, 0.5)
    )(record_payments if batch else record_payment)


def refusing_kafka_commits(runner: KafkaRunner) -> KafkaRunner:
    """Kafka refuses every offset commit of this runner (as during a rebalance storm): only
    the offsets in Postgres can tell the next owner where to start."""

    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise KafkaError("refused by the test")

    runner._kafka.commit = refuse  # type: ignore[method-assign]
    return runner


async def test_a_rebalance_between_two_consumers_hands_partitions_over_at_their_stored_offsets(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
) -> None:
    topic = await kafka_topic_factory("offsets-rebalance", partitions=4)
    messages = plan(600, 0.0, 3, run_id)
    await send_kafka(messages, topic)

    @idempotent_consumer(store, scope=f"scope-{run_id}", key=header("idempotency-key"), batch=True)
    async def slow(batch: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(batch, conn)
        await asyncio.sleep(0.2)  # ~200 msg/s over 4 partitions: the second joins mid-topic

    def runner() -> KafkaRunner:
        return refusing_kafka_commits(
            KafkaRunner(
                slow,
                topics=[topic],
                group_id=run_id,
                max_records=10,  # small batches: the rebalance lands mid-topic
                offsets_in_postgres=True,
                outbox_relay=None,
                consumer_options=FAST,
            )
        )

    first, second = runner(), runner()
    stops = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(first.run(stops[0]))]
    try:

        async def begun() -> bool:
            return first.stats.processed >= 40

        await wait_until(begun, 60, "the first consumer to begin")
        tasks.append(asyncio.create_task(second.run(stops[1])))

        async def shared_and_done() -> bool:
            return second.stats.processed > 0 and (
                first.stats.processed + second.stats.processed >= len(messages)
            )

        await wait_until(shared_and_done, 90, "both consumers to finish the topic together")
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await assert_exactly_once(pg_pool, run_id, messages)
    # no record was met twice, although Kafka never took a single offset commit
    assert first.stats.duplicates + second.stats.duplicates == 0
    assert first.stats.processed + second.stats.processed == len(messages)
    assert await committed(settings, run_id, topic) is None
    ends = await stored_offsets(store, run_id, topic, 4)
    assert sum(ends.values()) == len(messages)


async def test_a_partition_moves_to_a_consumer_that_never_saw_it(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
) -> None:
    """The first owner dies right after a Postgres commit, before its Kafka commit; a new
    process of the group that never saw the partition takes it over (once the dead member's
    session expired) and starts at the offset stored in Postgres, not at Kafka's."""
    topic = await kafka_topic_factory("offsets-move")
    messages = plan(30, 0.0, 4, run_id)
    await send_kafka(messages, topic)
    killed = await child(pg_dsn, topic, run_id, f"scope-{run_id}", "batch", "committed", "3", "on")
    await asyncio.wait_for(killed.wait(), timeout=60)
    assert killed.returncode == -signal.SIGKILL
    left = await ledger_count(pg_pool, run_id)
    stored = (await stored_offsets(store, run_id, topic, 1))[0]
    assert stored == left > (await committed(settings, run_id, topic) or 0)

    newcomer = KafkaRunner(
        ledger(store, f"scope-{run_id}", batch=True),
        topics=[topic],
        group_id=run_id,
        offsets_in_postgres=True,
        outbox_relay=None,
        consumer_options=FAST,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(newcomer.run(stop))
    try:

        async def finished() -> bool:
            return newcomer.stats.processed >= len(messages) - left

        await wait_until(finished, 60, "the newcomer to finish the partition")
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    await assert_exactly_once(pg_pool, run_id, messages)
    assert newcomer.stats.duplicates == 0
    assert newcomer.stats.processed == len(messages) - left
    assert await committed(settings, run_id, topic) == len(messages)  # advisory copy


async def test_a_producer_retry_at_a_new_offset_is_still_caught_by_its_key(
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
) -> None:
    """Stored offsets only say where to start reading; a retried publish is a new record, and
    its key makes it a replay. A poison record last: dead-lettered, and its offset is stored
    after its dead letter was published (not with a transaction)."""
    topic = await kafka_topic_factory("offsets-retry")
    items = [({"idempotency-key": f"k{i}".encode()}, payment(run_id, i)) for i in range(3)]
    items.append(({"idempotency-key": b"k1"}, payment(run_id, 1)))  # the producer's retry
    items.append(({"idempotency-key": b"poison"}, b'{"payment_id": 1}'))
    await send_raw(kafka_producer, topic, items)
    runner = KafkaRunner(
        ledger(store, f"scope-{run_id}"),
        topics=[topic],
        group_id=run_id,
        offsets_in_postgres=True,
        outbox_relay=None,
        consumer_options=FAST,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= len(items)

        await wait_until(settled, 60, "every record to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert await ledger_count(pg_pool, run_id) == 3
    assert runner.stats.duplicates == 1
    assert runner.stats.dead_lettered == 1
    assert await stored_offsets(store, run_id, topic, 1) == {0: len(items)}


def test_offsets_in_postgres_needs_an_idempotent_consumer() -> None:
    class NotOne:
        batch = False
        scope = "x"
        store: Any = None

    with pytest.raises(TypeError, match="idempotent_consumer"):
        KafkaRunner(NotOne(), topics=["t"], group_id="g", offsets_in_postgres=True)  # type: ignore[arg-type]


async def recreate_topic(admin: Any, topic: str) -> None:
    """Delete ``topic`` and create it again under its name (a new, empty log)."""
    await admin.delete_topics([topic])
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        try:
            if topic not in await admin.list_topics():
                await admin.create_topics([NewTopic(topic, 1, 1)])
                return
        except (TopicAlreadyExistsError, KafkaError):  # still being deleted
            pass
        assert asyncio.get_running_loop().time() < deadline, "the topic was not created again"
        await asyncio.sleep(0.5)


async def test_a_topic_created_again_runs_every_record_of_its_new_log(
    settings: Settings,
    store: PostgresStore,
    kafka_admin: Any,
    kafka_topic_factory: Any,
    run_id: str,
) -> None:
    """Offsets stored for a topic that was deleted and created again belong to the old log:
    the runner starts the new one at Kafka's committed offset (gone with the topic), runs all
    of its records, says so and counts it."""
    topic = await kafka_topic_factory("offsets-recreated")
    ran: list[str] = []

    @idempotent_consumer(store, scope=f"scope-{run_id}", key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        ran.append(message.headers["idempotency-key"].decode())

    async def produce(prefix: str, n: int) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(n):
                headers = [("idempotency-key", f"{run_id}-{prefix}-{i}".encode())]
                await producer.send_and_wait(topic, b"{}", headers=headers)
        finally:
            await producer.stop()

    async def consume(prefix: str, n: int) -> None:
        runner = KafkaRunner(
            handler,
            topics=[topic],
            group_id=run_id,
            offsets_in_postgres=True,
            outbox_relay=None,
            consumer_options=FAST,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        try:

            async def all_ran() -> bool:
                return sum(k.startswith(f"{run_id}-{prefix}-") for k in ran) >= n

            await wait_until(all_ran, 45, f"the {n} {prefix} records to run")
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)

    await produce("old", 10)
    await consume("old", 10)
    assert await stored_offsets(store, run_id, topic, 1) == {0: 10}

    await recreate_topic(kafka_admin, topic)
    await produce("new", 12)
    await consume("new", 12)
    assert sorted(k for k in ran if "-new-" in k) == sorted(f"{run_id}-new-{i}" for i in range(12))
    assert store.metrics.count("stored_offset_discarded", f"scope-{run_id}") == 1
    assert await stored_offsets(store, run_id, topic, 1) == {0: 12}


async def test_a_repeated_key_with_another_payload_in_a_batch_holds_the_stored_offset(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    run_id: str,
) -> None:
    """Batch mode, offsets in Postgres: a key met again in the batch with another payload is
    misuse, to dead-letter; the batch's COMMIT stores the offset only up to the record before
    it, so while its dead letter cannot be written yet the stored offset stays there, and a
    crash then would meet it again instead of skipping it."""
    topic = await kafka_topic_factory("offsets-misuse")
    dlq = f"{topic}.dlq"
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        items = [
            ("k1", payment(run_id, 1)),
            ("k1", payment(run_id, 1, amount=999)),  # the same key, another payload
            ("k2", payment(run_id, 2)),
        ]
        for key, body in items:
            await producer.send_and_wait(
                topic, body, headers=[("idempotency-key", f"{run_id}-{key}".encode())]
            )
    finally:
        await producer.stop()
    runner = KafkaRunner(
        ledger(store, f"scope-{run_id}", batch=True),
        topics=[topic],
        group_id=run_id,
        offsets_in_postgres=True,
        outbox_relay=None,
        consumer_options=FAST,
    )
    refused = RefusedDeadLetters(runner, dlq)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def first_stored() -> bool:
            return await stored_offsets(store, run_id, topic, 1) == {0: 1}

        await wait_until(first_stored, 30, "the batch to commit")
        await asyncio.sleep(2)  # the dead letter is refused again and again
        assert await stored_offsets(store, run_id, topic, 1) == {0: 1}
        assert runner.stats.dead_lettered == 0
        refused.end()

        async def all_settled() -> bool:
            return await stored_offsets(store, run_id, topic, 1) == {0: 3}

        await wait_until(all_settled, 30, "the dead letter to go out and the offset to move")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert runner.stats.dead_lettered == 1
    assert await ledger_count(pg_pool, run_id) == 2
