import asyncio
import os

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
store = PostgresStore.from_dsn(DSN)  # its pool opens on first use


# key: the idempotency-key header
@idempotent_consumer(store, scope="payments.ledger")
async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> dict:
    payment = message.json()  # conn: the transaction that records the key
    await conn.execute(
        "INSERT INTO ledger VALUES ($1, $2)", payment["id"], payment["cents"]
    )
    return {"booked": payment["id"]}  # stored, replayed to every duplicate


async def main() -> None:
    # creates the "consumer_idem" schema (or: consumer-idem migrate)
    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS ledger (payment_id text, cents int)"
    )
    message = ConsumerMessage(
        b'{"id": "pay-1", "cents": 1250}', {"idempotency-key": b"pay-1"}
    )
    for _ in range(3):  # the broker delivers it three times
        verdict = await book.process(message)
        how = "duplicate" if verdict.duplicate else "executed"
        print(verdict.action, how, verdict.result)
    query = "SELECT count(*) FROM ledger WHERE payment_id = 'pay-1'"
    print(await store.pool.fetchval(query), "row")
    await store.close()


asyncio.run(main())
