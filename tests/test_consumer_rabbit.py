"""`@idempotent_consumer` on RabbitMQ, runner in-process, against the real broker and database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import asyncpg
import pytest

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
from consumer_idem.transports.rabbit import RabbitRunner, to_message
from examples.payments_producer import plan, send_rabbit
from handlers.payments import record_payment
from tests._payments import assert_exactly_once, ledger_count, payment, wait_until
from tests.conftest import delete_queues


@pytest.fixture
def run_id() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def queues(settings: Settings, queue_name: str) -> Any:
    yield queue_name
    await delete_queues(settings, queue_name, f"{queue_name}.dlq", f"{queue_name}.reconcile")


def ledger_consumer(store: PostgresStore, scope: str) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), backoff=(0.1, 1.0)
    )(record_payment)


async def drain(queue: aio_pika.abc.AbstractQueue, within: float = 10) -> list[Any]:
    out = []
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        message = await queue.get(fail=False, no_ack=True)
        if message is None:
            if out:
                break
            await asyncio.sleep(0.2)
            continue
        out.append(message)
    return out


async def test_producer_duplicates_and_broker_redelivery_are_absorbed(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    messages = plan(150, 0.3, 9, run_id)
    await send_rabbit(messages, queues)
    consumer = ledger_consumer(store, scope)

    # A consumer that commits its work and then dies before acking: the broker redelivers.
    crashing = await aio_pika.connect(settings.amqp_url)
    channel = await crashing.channel()
    await channel.set_qos(prefetch_count=40)
    queue = await channel.get_queue(queues)
    taken = 0
    async with queue.iterator() as it:
        async for incoming in it:
            verdict = await consumer.process(to_message(incoming))
            assert verdict.action.value == "ack"
            taken += 1
            if taken == 40:
                break
    await crashing.close()  # 40 unacked deliveries go back to the queue
    booked_before = await ledger_count(pg_pool, run_id)
    assert 30 <= booked_before <= 40

    runner = RabbitRunner(consumer, queue=queues, prefetch=16)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def all_settled() -> bool:
            return runner.stats.processed >= len(messages)

        await wait_until(all_settled, 60, "every delivery to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert runner.stats.processed == len(messages) == 195
    # 45 producer re-sends plus the redelivered ones the crashing consumer had completed
    assert runner.stats.duplicates == 45 + booked_before
    await assert_exactly_once(pg_pool, run_id, messages)


async def test_bad_input_is_dead_lettered_with_reasons(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments={"x-queue-type": "quorum"})
    items: list[tuple[dict[str, Any], bytes]] = [
        # an AMQP byte-array header ('x') with bytes that are not UTF-8
        ({"idempotency-key": bytearray(b"\xff\xfe\xfd")}, payment(run_id, 1)),
        ({"idempotency-key": "k" * 10_240}, payment(run_id, 2)),
        ({}, payment(run_id, 3)),
        ({"idempotency-key": "json-1"}, b"{not json"),
        ({"idempotency-key": "good-1"}, payment(run_id, 4)),
        ({"idempotency-key": "good-1"}, payment(run_id, 4, amount=999)),
        ({"idempotency-key": "fields-1"}, b'{"payment_id": "x"}'),
        ({"idempotency-key": "good-2"}, payment(run_id, 5)),
    ]
    for headers, body in items:  # one at a time, so they are consumed in this order
        await channel.default_exchange.publish(
            aio_pika.Message(body, headers=headers), routing_key=queues
        )
    runner = RabbitRunner(ledger_consumer(store, scope), queue=queues, prefetch=1)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= len(items)

        await wait_until(settled, 30, "every delivery to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    dlq = await channel.get_queue(f"{queues}.dlq")
    dead = await drain(dlq)
    assert [m.headers["x-dead-letter-reason"] for m in dead] == [
        "invalid_key:invalid_utf8",
        "invalid_key:too_long",
        "invalid_key:missing_key",
        "invalid_json",
        "key_misuse",
        "invalid_payment",
    ]
    assert all(m.headers["x-original-queue"] == queues for m in dead)
    assert await ledger_count(pg_pool, run_id) == 2
    await channel.close()


async def test_ambiguous_failure_publishes_a_confirmed_reconcile_notice_before_ack(
    amqp_connection: aio_pika.abc.AbstractConnection,
    store: PostgresStore,
    queues: str,
    scope: str,
) -> None:
    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raise Ambiguous("connection reset after the charge request was sent")

    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments={"x-queue-type": "quorum"})
    await channel.default_exchange.publish(
        aio_pika.Message(b'{"amount": 1}', headers={"idempotency-key": "pay-1"}),
        routing_key=queues,
    )
    runner = RabbitRunner(charge, queue=queues, reconcile_queue=f"{queues}.reconcile")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= 1

        await wait_until(settled, 30, "the delivery to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_published_at is not None
    notices = await drain(await channel.get_queue(f"{queues}.reconcile"))
    assert [n.headers["x-consumer-idem-key"] for n in notices] == ["pay-1"]
    source = await channel.get_queue(queues)
    assert source.declaration_result.message_count == 0  # acked
    await channel.close()


async def test_runner_reconnects_after_a_broker_restart_and_loses_nothing(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    from tests._broker import rabbitmqctl

    async def slow(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await record_payment(message, conn)
        await asyncio.sleep(0.05)

    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(slow)
    first = plan(600, 0.0, 11, run_id)  # 8 in parallel x 50 ms: several seconds of work
    await send_rabbit(first, queues)
    runner = RabbitRunner(consumer, queue=queues, prefetch=8)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def some() -> bool:
            return await ledger_count(pg_pool, run_id) >= 40

        await wait_until(some, 30, "progress before the restart")
        await rabbitmqctl("stop_app")  # drops the runner's connection with messages in hand
        assert await ledger_count(pg_pool, run_id) < 600
        await rabbitmqctl("start_app")

        async def all_booked() -> bool:
            return await ledger_count(pg_pool, run_id) >= 600

        await wait_until(all_booked, 120, "the runner to reconnect and finish")
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert runner.stats.duplicates > 0  # deliveries in hand at the restart came back: replays
    await assert_exactly_once(pg_pool, run_id, first)


async def test_a_message_returned_by_consumers_that_never_ran_it_still_runs(
    settings: Settings,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments={"x-queue-type": "quorum"})
    await channel.default_exchange.publish(
        aio_pika.Message(b'{"n": 1}', headers={"idempotency-key": "killer"}), routing_key=queues
    )
    for _ in range(2):  # two consumers die holding it, unrun: the quorum queue counts both
        doomed = await aio_pika.connect(settings.amqp_url)
        q = await (await doomed.channel()).get_queue(queues)
        assert await q.get(timeout=5) is not None
        await doomed.close()
    calls = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1

    runner = RabbitRunner(handler, queue=queues, max_deliveries=2)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= 1

        await wait_until(settled, 30, "the delivery to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    # the budget counts the attempts that ran its handler (none), not the broker's returns
    assert calls == 1 and runner.stats.dead_lettered == 0
    assert await drain(await channel.get_queue(f"{queues}.dlq")) == []
    await channel.close()
