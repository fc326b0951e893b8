"""run_transactional: the claim, your writes and the stored result commit in
one transaction."""

import asyncio
import json
import os

import asyncpg

from consumer_idem import (
    OutcomeKind,
    PostgresStore,
    fingerprint_payload,
    run_transactional,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    # schema "consumer_idem", 30 s lease, 7 day retention
    store = PostgresStore(pool)
    await store.migrate()  # or: consumer-idem migrate
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS charges_ledger (payment_id text, cents int)"
    )

    # the message's raw bytes
    body = b'{"payment_id": "pay-42", "amount_cents": 100}'
    payment = json.loads(body)

    # inside the claim's transaction
    async def book(conn: asyncpg.Connection) -> dict[str, str]:
        await conn.execute(
            "INSERT INTO charges_ledger VALUES ($1, $2)",
            payment["payment_id"],
            payment["amount_cents"],
        )
        # stored (JSON) and replayed to duplicates
        return {"booked": payment["payment_id"]}

    for _ in range(2):
        outcome = await run_transactional(
            store, "ledger-consumer", "pay-42", fingerprint_payload(body), book
        )
        # executed, then replayed: the same result
        print(outcome.kind, outcome.result)
        # executed, replayed, misuse or unknown: ack the delivery now
        assert outcome.ackable

    # the same key with other bytes is misuse: never a replay, never a second
    # run
    other = b'{"payment_id": "pay-42", "amount_cents": 999}'
    outcome = await run_transactional(
        store, "ledger-consumer", "pay-42", fingerprint_payload(other), book
    )
    assert outcome.kind is OutcomeKind.MISUSE
    await pool.close()


asyncio.run(main())
