"""A FastStream app with idempotent subscribers: run it with

faststream run faststream_app:app
"""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, header
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotentConnection,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# the docs' tests pass a fresh topic
TOPIC = os.environ.get("DOCS_TOPIC", "docs.faststream.payments")

broker = KafkaBroker(BOOTSTRAP, acks="all", enable_idempotence=True)
store = PostgresStore.from_dsn(DSN)  # its pool opens on start-up, below

router = KafkaRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.faststream.ledger",
            key=header("idempotency-key"),
        ),
    ]
)


@router.subscriber(
    TOPIC,
    group_id=f"{TOPIC}.ledger",
    auto_offset_reset="earliest",
    ack_policy=AckPolicy.MANUAL,
)
@router.publisher(f"{TOPIC}.recorded")
async def book(
    body: dict[str, Any], conn: IdempotentConnection, idem: CurrentIdempotency
) -> dict[str, str]:
    await conn.execute(
        "INSERT INTO faststream_ledger VALUES ($1, $2)",
        body["id"],
        body["cents"],
    )
    # stored with the record; published again for each duplicate
    return {"recorded": body["id"], "key": idem.key}


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.open()  # an unreachable database fails the start-up
    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS faststream_ledger"
        " (payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """What `faststream run` does, for a few seconds: three copies of a payment,
    booked once."""
    import asyncio
    import json
    import uuid

    from aiokafka import AIOKafkaProducer

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
    q = "SELECT count(*) FROM faststream_ledger WHERE payment_id = $1"
    async with asyncio.timeout(30):
        while not await store.pool.fetchval(q, payment_id):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # the two duplicates come right after: they replay
    rows = await store.pool.fetchval(q, payment_id)
    await app.stop()
    print(f"booked {rows} time(s)")
    assert rows == 1


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
