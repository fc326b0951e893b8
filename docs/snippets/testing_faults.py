"""Fault injection for your own tests: a COMMIT that lands while the client
never hears."""

# --8<-- [start:faults]
import asyncio
import os
import uuid

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer
from consumer_idem.testing import (
    Fault,
    FaultyPool,
    Kind,
    Point,
    check_invariants,
    deliver,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


async def book_payment(
    message: ConsumerMessage, conn: asyncpg.Connection
) -> None:
    await conn.execute(
        "INSERT INTO faults_ledger VALUES ($1)", message.json()["id"]
    )


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    await PostgresStore(pool).migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS faults_ledger (payment_id text)"
    )
    pid = f"pay-{uuid.uuid4().hex[:8]}"
    message = ConsumerMessage(
        b'{"id": "%s"}' % pid.encode(), {"idempotency-key": pid.encode()}
    )

    faulty = FaultyPool(pool)
    store = PostgresStore(faulty)
    consumer = idempotent_consumer(store, scope="docs.faults")(book_payment)
    # the COMMIT lands; the client never hears
    faulty.arm(Fault(Point.COMMIT, Kind.DROP_AFTER))
    delivery = await deliver(consumer.process, message)
    # the redelivery replayed it: booked once
    assert delivery.acked and delivery.final.duplicate
    rows = await pool.fetchval(
        "SELECT count(*) FROM faults_ledger WHERE payment_id = $1", pid
    )
    record = await store.get("docs.faults", pid)
    check_invariants(
        delivery,
        effects=rows,
        status=record and record.status,
        unknown_noticed=False,
    )
    print(f"{delivery.deliveries} deliveries, booked {rows} time(s)")
    await pool.close()


# --8<-- [end:faults]


asyncio.run(main())
