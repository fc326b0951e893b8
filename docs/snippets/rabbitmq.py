"""RabbitRunner: a payment published three times to a queue, booked once."""

import asyncio
import json
import os
import uuid

import aio_pika
import asyncpg

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.transports.rabbit import RabbitRunner  # pip install 'consumer-idem[rabbit]'

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
AMQP_URL = os.environ.get("CONSUMER_IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
QUEUE = os.environ.get("DOCS_QUEUE", "docs.payments")  # the docs' tests pass a fresh one


def ledger_consumer(store: PostgresStore) -> IdempotentConsumer:
    @idempotent_consumer(store, scope="docs.rabbit.ledger", key=header("idempotency-key"))
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        p = message.json()
        await conn.execute("INSERT INTO rabbit_ledger VALUES ($1, $2)", p["id"], p["cents"])

    return book


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS rabbit_ledger (payment_id text, cents int)")

    # --8<-- [start:run]
    runner = RabbitRunner(ledger_consumer(store), queue=QUEUE, prefetch=32)
    await runner.start()  # declares the queue (durable, quorum) and its dead-letter queue
    stop = asyncio.Event()  # set it on SIGTERM: the runner finishes what it holds, then exits
    running = asyncio.create_task(runner.run(stop))
    # --8<-- [end:run]

    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect_robust(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for _ in range(3):  # the same payment, published three times
            body = json.dumps({"id": payment_id, "cents": 1250}).encode()
            message = aio_pika.Message(body, headers={"idempotency-key": payment_id})
            await channel.default_exchange.publish(message, routing_key=QUEUE)
        async with asyncio.timeout(30):
            while runner.stats.duplicates < 2:  # noqa: ASYNC110 (a demo: it polls)
                await asyncio.sleep(0.1)
    stop.set()
    await running
    rows = await pool.fetchval(
        "SELECT count(*) FROM rabbit_ledger WHERE payment_id = $1", payment_id
    )
    print(f"booked {rows} time(s); {runner.stats}")
    assert rows == 1
    await pool.close()


asyncio.run(main())
