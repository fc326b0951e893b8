"""The Kafka paths at scale, on the real broker and database: a partition waiting to retry
holds no concurrency slot, every record is prepared (key, fingerprint) once, and the round
trips each path sends to Postgres, counted with asyncpg's query logger."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    fingerprint_payload,
    header,
    idempotent_consumer,
)
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.kafka_offsets import OffsetHook, PostgresOffsets
from handlers.payments import record_payment, record_payments
from tests._payments import ledger_count, payment, send_raw, wait_until
from tests.test_consumer_kafka import FAST


@pytest.fixture
def run_id() -> str:
    return f"ks{uuid.uuid4().hex[:8]}"


def ledger(store: PostgresStore, scope: str, batch: bool = False) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=batch, backoff=(0.1, 0.3)
    )(record_payments if batch else record_payment)


async def test_a_partition_waiting_to_retry_holds_no_slot(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    """One slot, two partitions: partition 0 waits for a key held elsewhere (retrying with
    backoff); partition 1's records still run meanwhile."""
    topic = await kafka_topic_factory("slots", partitions=2)
    held = payment(run_id, 0)
    holder = await store.reserve(scope, "held", fingerprint_payload(held), lease=60)
    await send_raw(kafka_producer, topic, [({"idempotency-key": b"held"}, held)], partition=0)
    runner = KafkaRunner(
        ledger(store, scope),
        topics=[topic],
        group_id=run_id,
        max_partitions_in_flight=1,
        outbox_relay=None,
        consumer_options=FAST,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def waiting() -> bool:
            return runner.stats.retries >= 2

        await wait_until(waiting, 30, "partition 0 to wait for the held key")
        items = [({"idempotency-key": f"p1-{i}".encode()}, payment(run_id, i)) for i in (1, 2, 3)]
        await send_raw(kafka_producer, topic, items, partition=1)

        async def others_ran() -> bool:
            return await ledger_count(pg_pool, run_id) == 3

        await wait_until(others_ran, 15, "partition 1 to run while partition 0 waits")
        assert runner.stats.processed == 3  # the held record is still waiting
        await store.evict(scope, "held", token=holder.token)  # its owner gave up: it runs

        async def all_ran() -> bool:
            return await ledger_count(pg_pool, run_id) == 4

        await wait_until(all_ran, 15, "the held record to run")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_every_record_is_prepared_once_most_of_them_ahead(
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys and fingerprints are computed while the partition's transaction is in flight
    (by the runner's preparer task) and never again by the consumer."""
    topic = await kafka_topic_factory("prepare")
    items = [({"idempotency-key": f"k{i}".encode()}, payment(run_id, i)) for i in range(60)]
    await send_raw(kafka_producer, topic, items)
    consumer = ledger(store, scope, batch=True)
    where: list[str] = []
    original = consumer._prepare

    def counting(message: ConsumerMessage) -> Any:
        task = asyncio.current_task()
        where.append(task.get_name() if task is not None else "")
        return original(message)

    monkeypatch.setattr(consumer, "_prepare", counting)
    runner = KafkaRunner(
        consumer,
        topics=[topic],
        group_id=run_id,
        max_records=10,
        outbox_relay=None,
        consumer_options=FAST,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def done() -> bool:
            return runner.stats.processed >= len(items)

        await wait_until(done, 30, "the topic to be consumed")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert runner.stats.executed == len(items)
    assert len(where) == len(items)
    assert any(name.startswith("consumer-idem prepare") for name in where)


class Queries:
    """Every statement sent on the pool's connections (asyncpg's query logger): once a
    statement is in asyncpg's cache, one statement is one round trip."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, record: Any) -> None:
        self.sent.append(record.query)

    async def during(self, work: Any) -> list[str]:
        await asyncio.sleep(0.05)  # the logger is called soon after each statement
        self.sent.clear()
        await work
        await asyncio.sleep(0.05)
        return list(self.sent)


@pytest.fixture
async def counted(pg_dsn: str) -> AsyncIterator[tuple[PostgresStore, Queries]]:
    queries = Queries()

    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(queries)

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1, init=init)
    assert pool is not None
    yield PostgresStore(pool), queries
    await pool.close()


def messages(run_id: str, numbers: range, keys: str = "k") -> list[ConsumerMessage]:
    return [
        ConsumerMessage(
            payment(run_id, n),
            {"idempotency-key": f"{keys}{n}".encode()},
            topic="t",
            partition=0,
            offset=n,
        )
        for n in numbers
    ]


def is_reset(sql: str) -> bool:
    """asyncpg's reset of a connection going back to its pool."""
    return sql.startswith("SELECT pg_advisory_unlock_all();") and "RESET ALL" in sql


async def test_round_trips_of_a_batch(
    counted: tuple[PostgresStore, Queries], store: PostgresStore, demo_tables: None, run_id: str
) -> None:
    """Batch mode, per batch: BEGIN (with the transaction's mark), one INSERT claiming every
    key, the handler's two statements, the check with the COMMIT (and, with offsets in
    Postgres, the offset upsert in that same round trip), and the pool's reset when the
    connection goes back. A batch meeting an existing key pays for the plain claim it tried:
    ROLLBACK and BEGIN again, the ON CONFLICT claim, one reservation per existing key; the
    next batches of the scope claim with ON CONFLICT straight away."""
    pg, queries = counted
    consumer = ledger(pg, f"rt-{run_id}", batch=True)
    hook = OffsetHook(PostgresOffsets(pg, run_id), {})
    # warm the connection's caches (statements, the reservation's row type) in another scope:
    # the pause after a conflict is per scope
    warm = ledger(pg, f"warm-{run_id}", batch=True)
    await warm.process_batch(messages(run_id, range(0, 5)), hook)
    await warm.process_batch(messages(run_id, range(0, 1)) + messages(run_id, range(5, 9)))

    sent = await queries.during(consumer.process_batch(messages(run_id, range(10, 30))))
    assert len(sent) == 6, sent
    assert sent[0].startswith("BEGIN; SET LOCAL") and is_reset(sent[-1])
    assert "ON CONFLICT" not in sent[1]  # the plain claim: no key had a row

    sent = await queries.during(consumer.process_batch(messages(run_id, range(30, 50)), hook))
    assert len(sent) == 6, sent
    assert "INSERT INTO" in sent[4] and "kafka_offsets" in sent[4] and "COMMIT" in sent[4]
    assert hook.stored == {("t", 0): 50}

    batch = messages(run_id, range(40, 41)) + messages(run_id, range(50, 60))
    sent = await queries.during(consumer.process_batch(batch, hook))
    assert len(sent) == 9, sent
    assert sent[2].startswith("ROLLBACK; BEGIN; SET LOCAL")
    assert "ON CONFLICT" in sent[3] and "reserve(" in sent[4]
    sent = await queries.during(consumer.process_batch(messages(run_id, range(60, 70)), hook))
    assert len(sent) == 6 and "ON CONFLICT" in sent[1], sent


async def test_round_trips_of_one_message_per_transaction(
    counted: tuple[PostgresStore, Queries], store: PostgresStore, demo_tables: None, run_id: str
) -> None:
    """One message per transaction, on the run's one connection: BEGIN with the claim, the
    handler's two statements, the result check with the COMMIT (and the offset upsert, with
    offsets in Postgres) and, after it, the next message's BEGIN with its claim: four for the
    run's first message, three for each after it, plus one pool reset per run. A duplicate:
    the claim, the reservation that finds it completed, the COMMIT of that reservation."""
    pg, queries = counted
    consumer = ledger(pg, f"rt1-{run_id}")
    hook = OffsetHook(PostgresOffsets(pg, run_id), {})
    await consumer.process_batch(messages(run_id, range(0, 2)), hook)  # warm the caches
    await consumer.process_batch(messages(run_id, range(0, 1)))

    sent = await queries.during(consumer.process_batch(messages(run_id, range(10, 15))))
    assert len(sent) == 4 + 3 * 4 + 1, sent
    commits = sent[3::3][:4]
    assert all("COMMIT; BEGIN; EXECUTE consumer_idem_claim" in s for s in commits)
    assert "BEGIN" not in sent[-2] and sent[-2].endswith("COMMIT"), sent  # the run's last
    sent = await queries.during(consumer.process_batch(messages(run_id, range(20, 25)), hook))
    assert len(sent) == 4 + 3 * 4 + 1, sent
    assert all("kafka_offsets" in s and "COMMIT" in s for s in sent[3::3][:5])
    assert hook.stored == {("t", 0): 25}
    sent = await queries.during(consumer.process_batch(messages(run_id, range(20, 21))))
    assert len(sent) == 3 + 1 and sent[2] == "COMMIT", sent
