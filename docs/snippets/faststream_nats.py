"""A FastStream NATS JetStream subscriber made idempotent: run it with

faststream run faststream_nats:app
"""

# --8<-- [start:app]
import os
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotentConnection,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
NATS_URL = os.environ.get("CONSUMER_IDEM_NATS_URL", "nats://127.0.0.1:4222")
# the docs' tests pass a fresh subject (it names the stream too)
SUBJECT = os.environ.get("DOCS_TOPIC", "docs-faststream-payments")

broker = NatsBroker(NATS_URL)
store = PostgresStore.from_dsn(DSN)  # its pool opens on start-up, below

router = NatsRouter(
    middlewares=[
        Idempotency(
            store,
            broker=broker,
            scope="docs.faststream.nats.ledger",
            # no key=: the idempotency-key header, else the publisher's
            # Nats-Msg-Id
            max_deliveries=5,  # then dead-lettered to SUBJECT.dlq
        ),
    ]
)


@router.subscriber(
    SUBJECT,
    # JetStream keeps each message until it is acked (the dead letters too)
    stream=JStream(SUBJECT, subjects=[SUBJECT, f"{SUBJECT}.dlq"]),
    durable="ledger",  # a durable consumer: it resumes where it stopped
    pull_sub=PullSub(batch_size=16),
    ack_policy=AckPolicy.MANUAL,  # the middleware acks after the commit
)
async def book(
    body: dict[str, Any],
    conn: IdempotentConnection,
    current: CurrentIdempotency,
) -> None:
    # the effect commits in the same transaction as the key's record
    await conn.execute(
        "INSERT INTO faststream_nats_ledger VALUES ($1, $2, $3)",
        current.key,
        body["id"],
        body["cents"],
    )


broker.include_router(router)
app = FastStream(broker)


@app.on_startup
async def open_store() -> None:
    await store.migrate()  # opens the store's pool
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS faststream_nats_ledger"
        " (key text, payment_id text, cents int)"
    )


@app.after_shutdown
async def close_store() -> None:
    await store.close()


# --8<-- [end:app]


async def main() -> None:
    """Five payments, each sent twice (a retry): each is booked once."""
    import asyncio
    import uuid

    run = uuid.uuid4().hex[:8]
    ids = [f"pay-{run}-{i}" for i in range(5)]
    await app.start()  # declares the stream and its consumer
    for payment_id in ids + ids:
        await broker.publish(
            {"id": payment_id, "cents": 1250},
            SUBJECT,
            headers={"idempotency-key": payment_id},
            stream=SUBJECT,  # wait for JetStream's ack
            timeout=5,  # the default 0.5 s is short on a busy host
        )
    query = (
        "SELECT count(*) FROM faststream_nats_ledger WHERE payment_id = ANY($1)"
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
