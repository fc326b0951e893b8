"""A FastStream app with an idempotent Redis stream subscriber: run it with

faststream run faststream_redis:app
"""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.redis import RedisBroker, RedisRouter, StreamSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotentConnection,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
REDIS = os.environ.get("CONSUMER_IDEM_REDIS_URL", "redis://127.0.0.1:6379")
# the docs' tests pass a fresh stream
STREAM = os.environ.get("DOCS_TOPIC", "docs.faststream.payments")

broker = RedisBroker(REDIS)
store = PostgresStore.from_dsn(DSN)  # its pool opens on start-up, below

router = RedisRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.faststream.redis.ledger",
            max_deliveries=5,  # then to the stream f"{STREAM}.dlq"
        ),
    ]
)


# One handler, two subscribers of the consumer group "ledger": the first
# reads new entries, ten at a time; the second claims (XAUTOCLAIM) entries
# left pending for 30 s: a retry, or what a consumer that died had in hand.
@router.subscriber(
    stream=StreamSub(
        STREAM, group="ledger", consumer="ledger-1", max_records=10
    ),
    ack_policy=AckPolicy.MANUAL,
)
@router.subscriber(
    stream=StreamSub(
        STREAM, group="ledger", consumer="ledger-1", min_idle_time=30_000
    ),
    ack_policy=AckPolicy.MANUAL,
)
async def book(
    body: dict[str, Any], conn: IdempotentConnection, idem: CurrentIdempotency
) -> None:
    await conn.execute(
        "INSERT INTO faststream_redis_ledger VALUES ($1, $2)",
        body["id"],
        body["cents"],
    )


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.open()  # an unreachable database fails the start-up
    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS faststream_redis_ledger"
        " (payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """What `faststream run` does, for a few seconds: three copies of a payment
    (as a producer retrying its XADD writes them), booked once, all acked."""
    import asyncio
    import uuid

    import redis.asyncio as redis

    payment_id = f"pay-{uuid.uuid4().hex[:8]}"
    await app.start()  # creates the group at the stream's end: publish after
    for _ in range(3):
        await broker.publish(
            {"id": payment_id, "cents": 1250},
            stream=STREAM,
            headers={"idempotency-key": payment_id},
        )
    q = "SELECT count(*) FROM faststream_redis_ledger WHERE payment_id = $1"
    async with asyncio.timeout(30):
        while not await store.pool.fetchval(q, payment_id):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # the two duplicates come right after: they replay
    rows = await store.pool.fetchval(q, payment_id)
    client = redis.from_url(REDIS)
    pending = await client.xpending(STREAM, "ledger")  # delivered, not acked
    await app.stop()
    await client.delete(STREAM)
    await client.aclose()
    print(f"booked {rows} time(s), {pending['pending']} entries unacked")
    assert rows == 1 and pending["pending"] == 0


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
