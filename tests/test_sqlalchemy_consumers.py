"""Handlers that write through a bound SQLAlchemy session, on real Kafka and Postgres:
``@idempotent_consumer`` + ``with_session`` under the Kafka runner (the example consumer), and a
FastStream subscriber injecting ``IdempotentSession``. The ORM writes commit with the record,
exactly once per key; a failure after an ORM write leaves nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaRouter
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumer_idem import PostgresStore, Status, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency
from consumer_idem.sqlalchemy import engine_store
from consumer_idem.sqlalchemy.faststream import IdempotentSession
from consumer_idem.transports.kafka import KafkaRunner
from examples.payments_consumer_sqlalchemy import Account, LedgerEntry, ledger_consumer
from examples.payments_producer import plan, send_kafka
from tests._payments import assert_exactly_once, ledger_count, wait_until
from tests.conftest import unique

FAST = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


@pytest.fixture(scope="module")
async def engine(pg_dsn: str, store: PostgresStore) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(make_url(pg_dsn).set(drivername="postgresql+asyncpg"))
    yield engine
    await engine.dispose()


@pytest.fixture(params=["engine", "asyncpg_pool"])
def sa_store(request: pytest.FixtureRequest, engine: AsyncEngine, store: PostgresStore) -> Any:
    return engine_store(engine) if request.param == "engine" else store


async def run_until(runner: KafkaRunner, done: Callable[[], Awaitable[bool]]) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await wait_until(done, 60, "the runner to finish")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=60)


async def test_the_example_consumer_books_each_payment_once_through_the_session(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, demo_tables: None, scope: str
) -> None:
    run_id = unique("sa")
    topic = unique("sa-payments")
    messages = plan(40, 0.3, 7, run_id)
    await send_kafka(messages, topic)
    runner = KafkaRunner(
        ledger_consumer(sa_store, scope),
        topics=[topic],
        group_id=unique("g"),
        consumer_options=FAST,
    )

    async def all_settled() -> bool:
        return runner.stats.processed >= len(messages)

    await run_until(runner, all_settled)
    await assert_exactly_once(pg_pool, run_id, messages)
    assert runner.stats.duplicates == len(messages) - len({m.key for m in messages})
    record = await sa_store.get(scope, messages[0].key)
    assert record is not None and record.status is Status.COMPLETED
    assert record.result == {"recorded": json.loads(messages[0].body)["payment_id"]}


async def test_faststream_injects_the_session_and_a_failure_after_a_write_leaves_nothing(
    settings: Settings,
    sa_store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    scope: str,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
) -> None:
    run_id = unique("fs")
    topic = await kafka_topic_factory("sa-fs")
    broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    idem = Idempotency(
        sa_store, broker=broker, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.5)
    )
    router = KafkaRouter(middlewares=[idem])
    failed_once: set[str] = set()
    seen_rows: list[int] = []

    @router.subscriber(
        topic, group_id=unique("g"), ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    async def handle(
        body: dict[str, Any], session: IdempotentSession, current: CurrentIdempotency
    ) -> dict[str, Any]:
        session.add(
            LedgerEntry(
                payment_id=body["payment_id"],
                customer_id=body["customer_id"],
                amount_cents=body["amount_cents"],
                currency="EUR",
            )
        )
        await session.merge(Account(customer_id=body["customer_id"], balance_cents=0))
        await session.flush()
        if body.get("fail_once") and current.key not in failed_once:
            failed_once.add(current.key)
            seen_rows.append(await ledger_count(pg_pool, run_id))  # not visible outside
            raise ConnectionError("after the ORM write")
        return {"booked": body["payment_id"]}

    broker.include_router(router)
    keys = [f"{run_id}-{i}" for i in range(10)]
    for i, key in enumerate(keys + keys[:4]):  # four duplicates
        body = {
            "payment_id": f"{run_id}-pay-{key.rsplit('-', 1)[1]}",
            "customer_id": f"{run_id}-cust-{i % 3}",
            "amount_cents": 100,
            "fail_once": key == keys[5],
        }
        await kafka_producer.send_and_wait(
            topic, json.dumps(body).encode(), headers=[("idempotency-key", key.encode())]
        )
    await broker.start()
    try:

        async def all_settled() -> bool:
            return idem.stats.processed >= 14

        await wait_until(all_settled, 60, "every record to be settled")
    finally:
        await broker.stop()
    assert await ledger_count(pg_pool, run_id) == 10
    assert failed_once == {keys[5]} and seen_rows and seen_rows[0] < 10
    record = await sa_store.get(scope, keys[5])
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    assert record.result == {"body": {"booked": f"{run_id}-pay-5"}}
