"""A FastStream app with idempotent subscribers: run it with

faststream run faststream_app:app
"""

import asyncio
import json
import os
import uuid
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, header
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
TOPIC = os.environ.get("DOCS_TOPIC", "docs.faststream.payments")  # the tests pass a fresh one

# --8<-- [start:app]
broker = KafkaBroker(BOOTSTRAP, acks="all", enable_idempotence=True)
stores: list[PostgresStore] = []  # opened on start-up, when there is an event loop

router = KafkaRouter(
    middlewares=[
        Idempotency(
            lambda: stores[0],  # the store, or a function returning it
            broker=broker,
            scope="docs.faststream.ledger",
            key=header("idempotency-key"),
        ),
    ]
)


@router.subscriber(
    TOPIC, group_id=f"{TOPIC}.ledger", auto_offset_reset="earliest", ack_policy=AckPolicy.MANUAL
)
@router.publisher(f"{TOPIC}.recorded")
async def book(
    body: dict[str, Any], conn: IdempotentConnection, idem: CurrentIdempotency
) -> dict[str, str]:
    await conn.execute("INSERT INTO faststream_ledger VALUES ($1, $2)", body["id"], body["cents"])
    return {"recorded": body["id"], "key": idem.key}  # stored; published again for duplicates


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS faststream_ledger (payment_id text, cents int)")
    stores.append(store)


# --8<-- [end:app]


async def main() -> None:
    """What `faststream run` does, for a few seconds: three copies of a payment, booked once."""
    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await producer.start()
    for _ in range(3):
        body = json.dumps({"id": payment_id, "cents": 1250}).encode()
        await producer.send_and_wait(
            TOPIC, body, headers=[("idempotency-key", payment_id.encode())]
        )
    await producer.stop()
    await app.start()
    pool = stores[0].pool
    query = "SELECT count(*) FROM faststream_ledger WHERE payment_id = $1"
    async with asyncio.timeout(30):
        while await pool.fetchval(query, payment_id) < 1:  # noqa: ASYNC110 (a demo: it polls)
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # the two duplicates come right after: they replay
    await app.stop()
    rows = await pool.fetchval(query, payment_id)
    print(f"booked {rows} time(s)")
    assert rows == 1
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
