"""RabbitRunner: a payment published three times to a queue, booked once."""

import asyncio
import os

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    header,
    idempotent_consumer,
)

# pip install 'consumer-idem[rabbit]'
from consumer_idem.transports.rabbit import RabbitRunner

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
AMQP_URL = os.environ.get(
    "CONSUMER_IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"
)
# the docs' tests pass a fresh queue
QUEUE = os.environ.get("DOCS_QUEUE", "docs.payments")

store = PostgresStore.from_dsn(DSN)  # its pool opens on first use


@idempotent_consumer(
    store, scope="docs.rabbit.ledger", key=header("idempotency-key")
)
async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
    p = message.json()
    await conn.execute(
        "INSERT INTO rabbit_ledger VALUES ($1, $2)", p["id"], p["cents"]
    )


async def main() -> None:
    import json
    import uuid

    import aio_pika

    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS rabbit_ledger (payment_id text, cents int)"
    )
    runner = RabbitRunner(book, queue=QUEUE, url=AMQP_URL, prefetch=32)
    # declares the queue (durable, quorum) and its dead-letter queue
    await runner.start()
    # set `stop` on SIGTERM: the runner finishes what it holds, then returns
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))

    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect_robust(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for _ in range(3):  # the same payment, published three times
            body = json.dumps({"id": payment_id, "cents": 1250}).encode()
            key = {"idempotency-key": payment_id}
            message = aio_pika.Message(body, headers=key)
            await channel.default_exchange.publish(message, routing_key=QUEUE)
        async with asyncio.timeout(30):
            while runner.stats.duplicates < 2:  # noqa: ASYNC110 (it polls)
                await asyncio.sleep(0.1)
    stop.set()
    await running
    rows = await store.pool.fetchval(
        "SELECT count(*) FROM rabbit_ledger WHERE payment_id = $1", payment_id
    )
    print(f"booked {rows} time(s); {runner.stats}")
    assert rows == 1
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
