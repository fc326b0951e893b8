"""RabbitRunner at its edges, on the real broker and database: a store outage longer than the
delivery budget, a dead-letter queue that refuses publishes, a retryable failure, and a processor
that raises."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import aio_pika
import asyncpg
import pytest

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    Verdict,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.rabbit import RabbitRunner
from handlers.payments import record_payment
from tests._broker import Outage
from tests._payments import ledger_count, payment, wait_until
from tests._runners import Started
from tests.conftest import QUORUM, delete_queues, unique


@pytest.fixture
def run_id() -> str:
    return f"rt{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def channel(settings: Settings) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(settings.amqp_url)
    yield await connection.channel(publisher_confirms=True)
    await connection.close()


@pytest.fixture
async def queue(settings: Settings) -> AsyncIterator[str]:
    name = unique("rq")
    yield name
    await delete_queues(settings, name, f"{name}.dlq", f"{name}.reconcile")


def ledger(store: PostgresStore, scope: str) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.2)
    )(record_payment)


async def publish(channel: aio_pika.abc.AbstractChannel, queue: str, key: str | None, body: bytes):  # type: ignore[no-untyped-def]
    await channel.declare_queue(queue, durable=True, arguments=QUORUM)
    headers = {} if key is None else {"idempotency-key": key}
    await channel.default_exchange.publish(aio_pika.Message(body, headers=headers), queue)


async def count(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def back_in_queue(channel: aio_pika.abc.AbstractChannel, queue: str, n: int) -> None:
    """Wait until ``n`` messages are ready again (the broker requeues a closed consumer's
    unacked deliveries asynchronously)."""

    async def ready() -> bool:
        return await count(channel, queue) == n

    await wait_until(ready, 10, f"{n} message(s) back in {queue}")


async def test_a_store_outage_longer_than_the_delivery_budget_dead_letters_nothing(
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    outage = await Outage.start(store, pg_dsn)
    await publish(channel, queue, "pay-1", payment(run_id, 1))
    running = Started(RabbitRunner(ledger(outage.down, scope), queue=queue, max_deliveries=2))
    try:
        await asyncio.sleep(3)  # far more than 2 "retry later"s at a 0.05-0.2 s backoff
        assert running.runner.stats.retries >= 4
        assert running.runner.stats.dead_lettered == 0
        outage.end()

        async def ran() -> bool:
            return running.runner.stats.processed >= 1

        await wait_until(ran, 15, "the message to run once the store is back")
    finally:
        await running.finish()
    assert running.runner.stats.dead_lettered == 0 and running.runner.stats.executed == 1
    assert await ledger_count(pg_pool, run_id) == 1
    assert await count(channel, f"{queue}.dlq") == 0
    assert await count(channel, queue) == 0


async def test_messages_stay_queued_through_a_store_outage_and_run_once_it_returns(
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    outage = await Outage.start(store, pg_dsn)
    for i in range(3):
        await publish(channel, queue, f"pay-{i}", payment(run_id, i))
    first = Started(RabbitRunner(ledger(outage.down, scope), queue=queue))
    await asyncio.sleep(2)
    await first.finish()  # the runner stops during the outage
    assert first.runner.stats.processed == 0
    await back_in_queue(channel, queue, 3)  # nothing acked, nothing lost
    outage.end()
    second = Started(RabbitRunner(ledger(outage.down, scope), queue=queue))
    try:

        async def ran() -> bool:
            return second.runner.stats.processed >= 3

        await wait_until(ran, 15, "the messages to run once the store is back")
    finally:
        await second.finish()
    assert await ledger_count(pg_pool, run_id) == 3


async def test_a_retryable_failure_is_delivered_again_and_runs_once(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    failures = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.2))
    async def flaky(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal failures
        await record_payment(message, conn)
        if failures < 2:
            failures += 1
            raise ConnectionError("the downstream table is locked; try again")

    await publish(channel, queue, "pay-1", payment(run_id, 1))
    running = Started(RabbitRunner(flaky, queue=queue))
    try:

        async def ran() -> bool:
            return running.runner.stats.processed >= 1

        await wait_until(ran, 15, "the message to run after its retries")
    finally:
        await running.finish()
    assert failures == 2 and running.runner.stats.retries >= 2
    assert await ledger_count(pg_pool, run_id) == 1
    assert await count(channel, queue) == 0


async def test_a_dead_letter_queue_that_refuses_publishes_leaves_the_delivery_unacked(
    store: PostgresStore,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    dlq = f"{queue}.dlq"
    await channel.declare_queue(
        dlq, durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    await publish(channel, queue, None, payment(run_id, 1))  # no key: to be dead-lettered
    running = Started(RabbitRunner(ledger(store, scope), queue=queue, declare=False))
    await asyncio.sleep(3)
    await running.finish()
    assert running.runner.stats.dead_lettered == 0 and running.runner.stats.processed == 0
    assert await count(channel, dlq) == 0
    await back_in_queue(channel, queue, 1)  # never acked: back in the queue


class FailsOnce:
    """A processor whose first ``process`` raises: a bug, or an error nobody classified."""

    batch = False

    def __init__(self, inner: IdempotentConsumer) -> None:
        self.inner = inner
        self.store = inner.store
        self.scope = inner.scope
        self.failed = False

    async def process(self, message: ConsumerMessage) -> Verdict:
        if not self.failed:
            self.failed = True
            raise RuntimeError("unexpected failure in process()")
        return await self.inner.process(message)

    async def process_batch(self, messages: Sequence[ConsumerMessage]) -> list[Verdict]:
        return [await self.process(m) for m in messages]


async def test_a_processor_that_raises_is_logged_and_its_delivery_handed_back(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="consumer_idem.transports.rabbit")
    await publish(channel, queue, "pay-1", payment(run_id, 1))
    processor = FailsOnce(ledger(store, scope))
    running = Started(RabbitRunner(processor, queue=queue, prefetch=1))
    try:

        async def ran() -> bool:
            return running.runner.stats.processed >= 1

        await wait_until(ran, 15, "the delivery to be handed back and run")
    finally:
        await running.finish()
    assert processor.failed and running.runner.stats.failures == 1
    assert any(r.exc_info for r in caplog.records), "the failure was not logged"
    assert await ledger_count(pg_pool, run_id) == 1
    assert await count(channel, queue) == 0


async def test_a_long_wait_is_handed_back_as_a_copy_that_spends_no_delivery(
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    """Past ``max_hold`` (kept under RabbitMQ's consumer_timeout) a waiting delivery goes back
    to the tail of its queue as a confirmed copy, the original acked: no x-delivery-count."""
    outage = await Outage.start(store, pg_dsn)
    await publish(channel, queue, "pay-1", payment(run_id, 1))
    running = Started(
        RabbitRunner(ledger(outage.down, scope), queue=queue, max_deliveries=2, max_hold=0.3)
    )
    try:
        await asyncio.sleep(3)  # about ten hand-backs
        assert running.runner.stats.dead_lettered == 0
        outage.end()

        async def ran() -> bool:
            return running.runner.stats.processed >= 1

        await wait_until(ran, 15, "the message to run once the store is back")
    finally:
        await running.finish()
    assert running.runner.stats.executed == 1 and running.runner.stats.dead_lettered == 0
    assert await ledger_count(pg_pool, run_id) == 1
    assert await count(channel, queue) == 0 and await count(channel, f"{queue}.dlq") == 0


async def test_a_dead_letter_no_queue_takes_leaves_the_delivery_unacked(
    store: PostgresStore,
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    """Unroutable (no dead-letter queue was declared): the broker returns the copy. Counting
    that as published would ack a message that is nowhere."""
    await publish(channel, queue, None, payment(run_id, 1))
    running = Started(RabbitRunner(ledger(store, scope), queue=queue, declare=False))
    await asyncio.sleep(2)
    await running.finish()
    assert running.runner.stats.dead_lettered == 0 and running.runner.stats.processed == 0
    await back_in_queue(channel, queue, 1)


async def test_a_store_never_migrated_stops_the_runner_at_start(
    pg_pool: asyncpg.Pool, queue: str, scope: str
) -> None:
    from consumer_idem.errors import SchemaMissing

    unmigrated = PostgresStore(pg_pool, schema=f"never_{uuid.uuid4().hex[:8]}")
    runner = RabbitRunner(ledger(unmigrated, scope), queue=queue)
    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await runner.run(asyncio.Event())
