"""A FastStream app with an idempotent Redis stream batch subscriber: run it
with

faststream run faststream_redis_batch:app
"""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.redis import RedisBroker, RedisRouter, StreamSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotentConnection,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
REDIS = os.environ.get("CONSUMER_IDEM_REDIS_URL", "redis://127.0.0.1:6379")
# the docs' tests pass a fresh stream
STREAM = os.environ.get("DOCS_TOPIC", "docs.faststream.batch-payments")
BOOK = "INSERT INTO faststream_redis_batch_ledger VALUES ($1, $2)"

broker = RedisBroker(REDIS)
store = PostgresStore.from_dsn(DSN)  # its pool opens on start-up, below

router = RedisRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.faststream.redis.batch-ledger",
            max_deliveries=5,  # then to the stream f"{STREAM}.dlq"
        ),
    ]
)


# New entries of the group "ledger", up to 50 at a time: one transaction
# for the whole batch, then each entry XACKed on its own.
@router.subscriber(
    stream=StreamSub(
        STREAM, group="ledger", consumer="ledger-1", batch=True, max_records=50
    ),
    ack_policy=AckPolicy.MANUAL,
)
async def book_batch(
    bodies: list[dict[str, Any]],
    conn: IdempotentConnection,
    current: CurrentIdempotencyBatch,
) -> None:
    await conn.executemany(BOOK, [(b["id"], b["cents"]) for b in bodies])


# What a batch left pending (a retry, a consumer that died) is claimed after
# 30 s by a single-entry subscriber of the same group: each runs alone.
@router.subscriber(
    stream=StreamSub(
        STREAM, group="ledger", consumer="ledger-1", min_idle_time=30_000
    ),
    ack_policy=AckPolicy.MANUAL,
)
async def book_one(
    body: dict[str, Any], conn: IdempotentConnection, idem: CurrentIdempotency
) -> None:
    await conn.execute(BOOK, body["id"], body["cents"])


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.open()  # an unreachable database fails the start-up
    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS faststream_redis_batch_ledger"
        " (payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """What `faststream run` does, for a few seconds: five payments, each
    written three times (as a producer retrying its XADD writes them), booked
    once each, every entry acked."""
    import asyncio
    import uuid

    import redis.asyncio as redis

    ids = [f"pay-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    await app.start()  # creates the group at the stream's end: publish after
    for _ in range(3):
        for payment_id in ids:
            await broker.publish(
                {"id": payment_id, "cents": 1250},
                stream=STREAM,
                headers={"idempotency-key": payment_id},
            )
    q = (
        "SELECT count(*) FROM faststream_redis_batch_ledger"
        " WHERE payment_id = ANY($1)"
    )
    client = redis.from_url(REDIS)

    async def pending() -> int:  # delivered, not acked
        return int((await client.xpending(STREAM, "ledger"))["pending"])

    async with asyncio.timeout(30):
        while await store.pool.fetchval(q, ids) < 5 or await pending():  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # nothing else comes: every copy replayed
    rows, left = await store.pool.fetchval(q, ids), await pending()
    await app.stop()
    await client.delete(STREAM)
    await client.aclose()
    print(f"booked {rows} payment(s), {left} entries unacked")
    assert rows == 5 and left == 0


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
