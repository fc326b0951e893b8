"""KafkaRunner: a payment sent three times to a topic, booked once."""

import asyncio
import json
import os
import uuid

import asyncpg
from aiokafka import AIOKafkaProducer

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.transports.kafka import KafkaRunner  # pip install 'consumer-idem[kafka]'

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
TOPIC = os.environ.get("DOCS_TOPIC", "docs.payments")  # the docs' tests pass a fresh one


def ledger_consumer(store: PostgresStore) -> IdempotentConsumer:
    @idempotent_consumer(store, scope="docs.kafka.ledger", key=header("idempotency-key"))
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        p = message.json()
        await conn.execute("INSERT INTO kafka_ledger VALUES ($1, $2)", p["id"], p["cents"])

    return book


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS kafka_ledger (payment_id text, cents int)")

    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await producer.start()
    for _ in range(3):  # a producer's retries: the same payment, three records
        body = json.dumps({"id": payment_id, "cents": 1250}).encode()
        await producer.send_and_wait(
            TOPIC, body, headers=[("idempotency-key", payment_id.encode())]
        )
    await producer.stop()

    # --8<-- [start:run]
    runner = KafkaRunner(ledger_consumer(store), topics=[TOPIC], group_id=f"{TOPIC}.ledger")
    stop = asyncio.Event()  # set it on SIGTERM: the runner finishes what it holds, commits, exits
    running = asyncio.create_task(runner.run(stop))
    # --8<-- [end:run]
    async with asyncio.timeout(30):
        while runner.stats.duplicates < 2:  # noqa: ASYNC110 (a demo: it polls)
            await asyncio.sleep(0.1)
    stop.set()
    await running
    rows = await pool.fetchval(
        "SELECT count(*) FROM kafka_ledger WHERE payment_id = $1", payment_id
    )
    print(f"booked {rows} time(s); {runner.stats}")
    assert rows == 1
    await pool.close()


asyncio.run(main())
