"""The transactional outbox: a handler's outgoing messages commit with its
effect."""

# --8<-- [start:handler]
import os

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    idempotent_consumer,
    outbox_for,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# the docs' tests pass a fresh queue
QUEUE = os.environ.get("DOCS_QUEUE", "docs.outbox.payments")
BOOKED = f"{QUEUE}.booked"
store = PostgresStore.from_dsn(DSN)


@idempotent_consumer(store, scope="docs.outbox.ledger")
async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
    p = message.json()
    await conn.execute(
        "INSERT INTO outbox_ledger VALUES ($1, $2)", p["id"], p["cents"]
    )
    # a row in this transaction: sent after the COMMIT, never without it; a
    # replayed duplicate does not run the handler, so it publishes nothing
    event = {"type": "payment.booked", "id": p["id"]}
    outbox_for(conn).publish(BOOKED, event)


# --8<-- [end:handler]
AMQP_URL = os.environ.get(
    "CONSUMER_IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"
)


async def main() -> None:
    import asyncio
    import json
    import uuid

    import aio_pika

    from consumer_idem.transports.rabbit import RabbitRunner

    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS outbox_ledger (payment_id text, cents int)"
    )
    connection = await aio_pika.connect_robust(AMQP_URL)
    channel = await connection.channel()
    booked = await channel.declare_queue(BOOKED, durable=True)

    # it sends what units commit
    runner = RabbitRunner(book, queue=QUEUE, url=AMQP_URL)
    await runner.start()
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"id": payment_id, "cents": 300}).encode()
    for _ in range(3):
        message = aio_pika.Message(
            body, headers={"idempotency-key": payment_id}
        )
        await channel.default_exchange.publish(message, routing_key=QUEUE)

    events = []
    async with asyncio.timeout(30):
        while runner.stats.duplicates < 2 or not events:
            incoming = await booked.get(fail=False)
            if incoming is None:
                await asyncio.sleep(0.1)
                continue
            await incoming.ack()
            if json.loads(incoming.body)["id"] == payment_id:
                events.append(incoming.headers["idempotency-key"])
    stop.set()
    await running
    print(f"{len(events)} payment.booked event for 3 deliveries")
    print(f"its idempotency-key header: {events[0]!r}")
    assert len(events) == 1
    await connection.close()
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
