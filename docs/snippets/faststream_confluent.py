"""A FastStream app on Confluent's Kafka client, idempotent: run it with

faststream run faststream_confluent:app
"""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.confluent import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, header
from consumer_idem.faststream import (
    Idempotency,
    IdempotentConnection,
    IdempotentOutbox,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
BOOTSTRAP = os.environ.get("CONSUMER_IDEM_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# the docs' tests pass a fresh topic
TOPIC = os.environ.get("DOCS_TOPIC", "docs.confluent.payments")

# librdkafka's producer waits for every in-sync replica (acks="all")
broker = KafkaBroker(BOOTSTRAP, acks="all")
store = PostgresStore.from_dsn(DSN)  # its pool opens on start-up, below

router = KafkaRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.confluent.ledger",
            key=header("idempotency-key"),
        ),
    ]
)


@router.subscriber(
    TOPIC,
    group_id=f"{TOPIC}.ledger",
    auto_offset_reset="earliest",
    ack_policy=AckPolicy.MANUAL,  # the middleware commits, after Postgres
)
async def book(
    body: dict[str, Any], conn: IdempotentConnection, outbox: IdempotentOutbox
) -> None:
    await conn.execute(
        "INSERT INTO confluent_ledger VALUES ($1, $2)",
        body["id"],
        body["cents"],
    )
    # committed with the row above; sent through the broker after the commit
    outbox.publish(f"{TOPIC}.recorded", {"recorded": body["id"]})


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.open()  # an unreachable database fails the start-up
    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS confluent_ledger"
        " (payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """What `faststream run` does, for a few seconds: three copies of a payment,
    booked once, announced once."""
    import asyncio
    import uuid

    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    announced: list[dict[str, Any]] = []

    @broker.subscriber(f"{TOPIC}.recorded", auto_offset_reset="earliest")
    async def watch(body: dict[str, Any]) -> None:
        announced.append(body)

    await app.start()
    for _ in range(3):
        await broker.publish(
            {"id": payment_id, "cents": 1250},
            TOPIC,
            headers={"idempotency-key": payment_id},
        )
    async with asyncio.timeout(30):
        while not announced:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # the two duplicates come right after: they replay
    q = "SELECT count(*) FROM confluent_ledger WHERE payment_id = $1"
    rows = await store.pool.fetchval(q, payment_id)
    await app.stop()
    print(f"booked {rows} time(s), announced {len(announced)} time(s)")
    assert rows == 1 and announced == [{"recorded": payment_id}]


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
