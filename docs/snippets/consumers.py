"""@idempotent_consumer: a factory that decorates at start-up, and the verdicts it returns."""

import asyncio
import json
import os
import uuid

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PoisonMessage,
    PostgresStore,
    first_of,
    header,
    idempotent_consumer,
    payload_field,
)

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")


# --8<-- [start:factory]
def ledger_consumer(store: PostgresStore) -> IdempotentConsumer:
    """Decorate at start-up, once the store exists: it needs a pool, and a pool needs the
    running event loop, so there is no store to decorate with at import time."""

    @idempotent_consumer(
        store,
        scope="docs.ledger",
        key=first_of(header("idempotency-key"), payload_field("payment_id")),
        max_attempts=5,
    )
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> dict[str, str]:
        payment = message.json()
        if payment.get("amount_cents", 0) <= 0:
            raise PoisonMessage("invalid_payment")  # dead-lettered at once, never retried
        await conn.execute(
            "INSERT INTO docs_ledger VALUES ($1, $2)",
            payment["payment_id"],
            payment["amount_cents"],
        )
        return {"booked": payment["payment_id"]}

    return book


# --8<-- [end:factory]


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS docs_ledger (payment_id text, cents int)")
    book = ledger_consumer(store)

    pid = f"pay-{uuid.uuid4().hex[:8]}"

    def message(body: object) -> ConsumerMessage:
        return ConsumerMessage(json.dumps(body).encode(), {"idempotency-key": pid.encode()})

    for label, delivery in [
        ("first delivery", message({"payment_id": pid, "amount_cents": 500})),
        ("duplicate", message({"payment_id": pid, "amount_cents": 500})),
        ("same key, other payload", message({"payment_id": pid, "amount_cents": 7})),
        (
            "keyed by the payload",
            ConsumerMessage(b'{"payment_id": "%s-b", "amount_cents": 9}' % pid.encode()),
        ),
        ("poison", ConsumerMessage(b'{"payment_id": "%s-c", "amount_cents": -1}' % pid.encode())),
        ("not JSON", ConsumerMessage(b"\xff", {"idempotency-key": b"k-not-json"})),
    ]:
        verdict = await book.process(delivery)
        print(f"{label:25} {verdict.action:12} {verdict.reason or ''}")
    # first: ack, duplicate: ack (replayed), misuse: dead_letter key_misuse,
    # payload key: ack, poison: dead_letter invalid_payment, not JSON: dead_letter invalid_json
    await pool.close()


asyncio.run(main())
