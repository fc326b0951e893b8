"""FastStream's RabbitMQ subscribers keep the delivery budget of every RabbitMQ consumer
(``max_deliveries`` counts the key's own runs, in Postgres), on the real broker and database
through a real ``RabbitBroker``: deliveries returned by consumers that died before running them
are not dead-lettered, and a key whose effect committed is acked past its budget."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import asyncpg
import pytest
from faststream import AckPolicy
from faststream.rabbit import QueueType, RabbitBroker, RabbitQueue, RabbitRouter

from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import Settings
from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection
from consumer_idem.stores.postgres.attempts import DeliveryAttempts
from tests._faststream import effect_count, write_effect
from tests._payments import wait_until
from tests.test_rabbit_batch import drain, ready_count, take_and_die
from tests.test_rabbit_budget import attempts

KEY = header("idempotency-key")
QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture
async def channel(
    amqp_connection: aio_pika.abc.AbstractConnection, queue_name: str
) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    channel = await amqp_connection.channel(publisher_confirms=True)
    for name in (queue_name, f"{queue_name}.dlq"):
        await channel.declare_queue(name, durable=True, arguments=QUORUM)
    yield channel
    for name in (queue_name, f"{queue_name}.dlq"):
        await channel.queue_delete(name)
    await channel.close()


def app(
    settings: Settings, store: PostgresStore, scope: str, queue: str, max_deliveries: int
) -> tuple[RabbitBroker, Idempotency, list[str]]:
    """A FastStream app whose subscriber writes one effect per message; ``ran`` lists the
    keys its handler ran for."""
    broker = RabbitBroker(settings.amqp_url)
    idem = Idempotency(
        store,
        broker=broker,
        scope=scope,
        key=KEY,
        backoff=(0.05, 0.2),
        max_deliveries=max_deliveries,
    )
    router = RabbitRouter(middlewares=[idem])
    ran: list[str] = []

    @router.subscriber(RabbitQueue(queue, queue_type=QueueType.QUORUM), ack_policy=AckPolicy.MANUAL)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        ran.append(current.key)
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    return broker, idem, ran


async def run_until_settled(broker: RabbitBroker, idem: Idempotency, settled: int) -> None:
    await broker.start()
    try:

        async def done() -> bool:
            return idem.stats.processed >= settled

        await wait_until(done, 30, f"{settled} deliveries to be settled")
    finally:
        await broker.stop()


async def test_deliveries_returned_by_consumers_that_died_before_running_them_are_not_dead_lettered(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    channel: aio_pika.abc.AbstractChannel,
    queue_name: str,
) -> None:
    """Three consumers die holding the first three deliveries, never having run them: the
    broker counts three deliveries each, past ``max_deliveries=2``. Those returns are not the
    keys' own runs: every message runs once, the returned ones counted one attempt each."""
    for n in range(6):
        await channel.default_exchange.publish(
            aio_pika.Message(json.dumps({"n": n}).encode(), headers={"idempotency-key": f"k{n}"}),
            routing_key=queue_name,
        )
    for _ in range(3):
        await take_and_die(settings, queue_name, 3)
    broker, idem, ran = app(settings, store, scope, queue_name, max_deliveries=2)

    await run_until_settled(broker, idem, 6)

    assert idem.stats.dead_lettered == 0
    assert await drain(channel, f"{queue_name}.dlq") == []
    assert sorted(ran) == [f"k{n}" for n in range(6)]
    assert await effect_count(pg_pool, scope) == 6
    for n in range(6):
        assert await attempts(store, scope, f"k{n}") == (1 if n < 3 else None)


async def test_a_committed_key_redelivered_past_its_budget_is_acked_not_dead_lettered(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    channel: aio_pika.abc.AbstractChannel,
    queue_name: str,
) -> None:
    """An effect that committed but whose acks kept being lost comes back with the broker's
    count past ``max_deliveries``, and its own runs (replays whose acks were lost too) spent
    its budget. The key's record says completed: the delivery is acked as a replay, never
    dead-lettered (a dead-letter replay after retention would book it twice)."""
    body = b'{"n": 1}'

    @idempotent_consumer(store, scope=scope, key=KEY)
    async def first_run(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO fs_effects (scope, key, n) VALUES ($1, 'paid', 1)", scope)

    done = await first_run.process(ConsumerMessage(body, {"idempotency-key": b"paid"}))
    assert done.action == "ack"  # committed; its ack is what was lost
    await channel.default_exchange.publish(
        aio_pika.Message(body, headers={"idempotency-key": "paid"}), routing_key=queue_name
    )
    for _ in range(3):  # returned again and again: the broker counts 3
        await take_and_die(settings, queue_name, 1)
    await DeliveryAttempts(store).count(scope, "paid")
    broker, idem, ran = app(settings, store, scope, queue_name, max_deliveries=1)

    await run_until_settled(broker, idem, 1)

    assert ran == [] and idem.stats.dead_lettered == 0 and idem.stats.duplicates == 1
    assert await drain(channel, f"{queue_name}.dlq") == []
    assert await ready_count(channel, queue_name) == 0
    assert await effect_count(pg_pool, scope) == 1


async def test_a_subscriber_queue_whose_delivery_limit_is_below_the_budget_is_refused(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queue_name: str,
) -> None:
    """A queue declared with ``x-delivery-limit: 2`` under a budget of 5: the broker would drop
    a message the budget still means to deliver. The broker refuses to start
    (``IdempotencyConfigError``) before it fetches anything: the handler never runs, nothing is
    acked or dead-lettered, and the message stays in its queue."""
    limited = {"x-delivery-limit": 2}
    broker = RabbitBroker(settings.amqp_url)
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY, max_deliveries=5)
    router = RabbitRouter(middlewares=[idem])
    ran: list[str] = []

    @router.subscriber(
        RabbitQueue(queue_name, queue_type=QueueType.QUORUM, arguments=limited),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(data: dict[str, Any], current: CurrentIdempotency) -> None:
        ran.append(current.key)

    broker.include_router(router)
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        await channel.declare_queue(queue_name, durable=True, arguments={**QUORUM, **limited})
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}', headers={"idempotency-key": "k1"}),
            routing_key=queue_name,
        )
        with pytest.raises(IdempotencyConfigError, match="x-delivery-limit is 2"):
            await broker.start()
        await broker.stop()
        assert ran == [] and idem.stats.processed == 0 and idem.stats.dead_lettered == 0

        async def back() -> bool:
            return await ready_count(channel, queue_name) == 1

        await wait_until(back, 10, "the message to be back in its queue")
    finally:
        await channel.queue_delete(queue_name)
        await channel.queue_delete(f"{queue_name}.dlq")
        await channel.close()
