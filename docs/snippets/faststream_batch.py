"""A FastStream Kafka batch subscriber made idempotent: one transaction per
delivered batch."""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, header
from consumer_idem.faststream import CurrentIdempotencyBatch, Idempotency

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# the docs' tests pass a fresh topic
TOPIC = os.environ.get("DOCS_TOPIC", "docs.faststream.batch")

broker = KafkaBroker(BOOTSTRAP, acks="all", enable_idempotence=True)
store = PostgresStore.from_dsn(DSN)
router = KafkaRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.faststream.batch",
            key=header("idempotency-key"),
        )
    ]
)


@router.subscriber(
    TOPIC,
    group_id=f"{TOPIC}.ledger",
    batch=True,  # a list of bodies per call
    max_records=500,
    auto_offset_reset="earliest",
    ack_policy=AckPolicy.MANUAL,
)
async def book(
    bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch
) -> list[str]:
    # only the records to run: duplicates (in this batch or earlier) were
    # answered already
    await current.conn.executemany(
        "INSERT INTO faststream_batch_ledger VALUES ($1, $2)",
        [(body["id"], body["cents"]) for body in bodies],
    )
    # one result per body (or None): stored with each record, published nowhere
    return [f"booked {body['id']}" for body in bodies]


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.migrate()  # opens the store's pool
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS faststream_batch_ledger"
        " (payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """Five payments, each sent twice: each is booked once."""
    import asyncio
    import json
    import uuid

    from aiokafka import AIOKafkaProducer

    run = uuid.uuid4().hex[:8]
    ids = [f"pay-{run}-{i}" for i in range(5)]
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await producer.start()
    for payment_id in ids + ids:
        body = json.dumps({"id": payment_id, "cents": 1250}).encode()
        key = [("idempotency-key", payment_id.encode())]
        await producer.send(TOPIC, body, headers=key)
    await producer.flush()
    await producer.stop()
    await app.start()
    query = (
        "SELECT count(*) FROM faststream_batch_ledger"
        " WHERE payment_id = ANY($1)"
    )
    async with asyncio.timeout(30):
        while await store.pool.fetchval(query, ids) < 5:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # anything still arriving would be a double
    rows = await store.pool.fetchval(query, ids)
    await app.stop()
    print(f"5 payments sent twice, booked {rows} times")
    assert rows == 5


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
