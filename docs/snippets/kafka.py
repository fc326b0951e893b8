"""KafkaRunner: a payment sent three times to a topic, booked once."""

import asyncio
import os

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    header,
    idempotent_consumer,
)

# pip install 'consumer-idem[kafka]'
from consumer_idem.transports.kafka import KafkaRunner

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# the docs' tests pass a fresh topic
TOPIC = os.environ.get("DOCS_TOPIC", "docs.payments")

store = PostgresStore.from_dsn(DSN)  # its pool opens on first use


@idempotent_consumer(
    store, scope="docs.kafka.ledger", key=header("idempotency-key")
)
async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
    p = message.json()
    await conn.execute(
        "INSERT INTO kafka_ledger VALUES ($1, $2)", p["id"], p["cents"]
    )


def make_runner() -> KafkaRunner:
    """Made in the running event loop (its aiokafka consumer needs one)."""
    return KafkaRunner(
        book,
        topics=[TOPIC],
        group_id=f"{TOPIC}.ledger",
        bootstrap_servers=BOOTSTRAP,
    )


async def main() -> None:
    import json
    import uuid

    from aiokafka import AIOKafkaProducer

    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS kafka_ledger (payment_id text, cents int)"
    )
    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await producer.start()
    for _ in range(3):  # a producer's retries: the same payment, three records
        body = json.dumps({"id": payment_id, "cents": 1250}).encode()
        await producer.send_and_wait(
            TOPIC, body, headers=[("idempotency-key", payment_id.encode())]
        )
    await producer.stop()

    runner = make_runner()
    # set `stop` on SIGTERM: the runner finishes what it holds, commits, returns
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    async with asyncio.timeout(30):
        while runner.stats.duplicates < 2:  # noqa: ASYNC110 (a demo: it polls)
            await asyncio.sleep(0.1)
    stop.set()
    await running
    rows = await store.pool.fetchval(
        "SELECT count(*) FROM kafka_ledger WHERE payment_id = $1", payment_id
    )
    print(f"booked {rows} time(s); {runner.stats}")
    assert rows == 1
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
