import asyncio
import os

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer

# the pooled DSN: PgBouncer in transaction mode, Supabase's port 6543, Neon's
# "-pooler" host...
DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# pooler="transaction": asyncpg's statement cache off (its prepared statements
# would land on other server connections), and no PREPARE kept, no session
# setting, no LISTEN: each transaction stands on its own
store = PostgresStore.from_dsn(DSN, pooler="transaction")


@idempotent_consumer(store, scope="payments.pooled")
async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
    await conn.execute(
        "INSERT INTO pooled_ledger VALUES ($1)", message.json()["id"]
    )


async def main() -> None:
    await store.migrate()  # one transaction: it goes through the pooler too
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS pooled_ledger (payment_id text PRIMARY KEY)"
    )
    message = ConsumerMessage(b'{"id": "pay-7"}', {"idempotency-key": b"pay-7"})
    for _ in range(3):  # delivered three times, booked once
        await book.process(message)
    count = await store.pool.fetchval("SELECT count(*) FROM pooled_ledger")
    assert count == 1
    await store.close()


asyncio.run(main())
