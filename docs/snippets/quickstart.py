import asyncio
import os

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()  # creates the "consumer_idem" schema (or: consumer-idem migrate)
    await pool.execute("CREATE TABLE IF NOT EXISTS ledger (payment_id text, cents int)")

    @idempotent_consumer(store, scope="payments.ledger")  # key: the idempotency-key header
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> dict[str, str]:
        payment = message.json()  # conn is in the transaction that records the key
        await conn.execute("INSERT INTO ledger VALUES ($1, $2)", payment["id"], payment["cents"])
        return {"booked": payment["id"]}  # stored, and replayed to every duplicate

    message = ConsumerMessage(b'{"id": "pay-1", "cents": 1250}', {"idempotency-key": b"pay-1"})
    for _ in range(3):  # the broker delivers it three times
        verdict = await book.process(message)
        print(verdict.action, "duplicate" if verdict.duplicate else "executed", verdict.result)
    print(await pool.fetchval("SELECT count(*) FROM ledger WHERE payment_id = 'pay-1'"), "row")
    await pool.close()


asyncio.run(main())
