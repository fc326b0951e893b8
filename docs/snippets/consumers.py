"""@idempotent_consumer on a store made at import time, and its verdicts."""

# --8<-- [start:factory]
import asyncio
import os

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PoisonMessage,
    PostgresStore,
    first_of,
    header,
    idempotent_consumer,
    payload_field,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# its asyncpg pool opens on first use (or `await store.open()` at start-up)
store = PostgresStore.from_dsn(DSN)


@idempotent_consumer(
    store,
    scope="docs.ledger",
    key=first_of(header("idempotency-key"), payload_field("payment_id")),
    max_attempts=5,
)
async def book(
    message: ConsumerMessage, conn: asyncpg.Connection
) -> dict[str, str]:
    payment = message.json()
    if payment.get("amount_cents", 0) <= 0:
        # dead-lettered at once, never retried
        raise PoisonMessage("invalid_payment")
    await conn.execute(
        "INSERT INTO docs_ledger VALUES ($1, $2)",
        payment["payment_id"],
        payment["amount_cents"],
    )
    return {"booked": payment["payment_id"]}


# --8<-- [end:factory]


async def main() -> None:
    import json
    import uuid

    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_ledger (payment_id text, cents int)"
    )
    pid = f"pay-{uuid.uuid4().hex[:8]}"

    def message(body: object) -> ConsumerMessage:
        key = {"idempotency-key": pid.encode()}
        return ConsumerMessage(json.dumps(body).encode(), key)

    other = b'{"payment_id": "%s-b", "amount_cents": 9}' % pid.encode()
    poison = b'{"payment_id": "%s-c", "amount_cents": -1}' % pid.encode()
    for label, delivery in [
        ("first delivery", message({"payment_id": pid, "amount_cents": 500})),
        ("duplicate", message({"payment_id": pid, "amount_cents": 500})),
        (
            "same key, other payload",
            message({"payment_id": pid, "amount_cents": 7}),
        ),
        ("keyed by the payload", ConsumerMessage(other)),
        ("poison", ConsumerMessage(poison)),
        (
            "not JSON",
            ConsumerMessage(b"\xff", {"idempotency-key": b"k-not-json"}),
        ),
    ]:
        verdict = await book.process(delivery)
        print(f"{label:25} {verdict.action:12} {verdict.reason or ''}")
    # first: ack, duplicate: ack (replayed), misuse: dead_letter key_misuse,
    # payload key: ack, poison: dead_letter invalid_payment,
    # not JSON: dead_letter invalid_json
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
