"""Typed results, and hooks that count real executions and replays."""

# --8<-- [start:typed]
import asyncio
import os
import uuid
from collections import Counter
from decimal import Decimal

import asyncpg
from pydantic import BaseModel

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    Verdict,
    header,
    idempotent_consumer,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
store = PostgresStore.from_dsn(DSN)
counts: Counter[str] = Counter()


class Receipt(BaseModel):
    payment_id: str
    amount: Decimal


def executed(verdict: Verdict) -> None:
    counts["executed"] += 1  # the handler ran and its work committed


def replayed(verdict: Verdict) -> None:
    counts["replayed"] += 1  # a duplicate: the stored result, not run again


@idempotent_consumer(
    store,
    scope="docs.receipts",
    key=header("idempotency-key"),
    on_execute=executed,
    on_replay=replayed,
)
async def charge(message: ConsumerMessage, conn: asyncpg.Connection) -> Receipt:
    body = message.json()
    return Receipt(payment_id=body["id"], amount=Decimal(body["amount"]))


# --8<-- [end:typed]


async def main() -> None:
    await store.migrate()
    key = {"idempotency-key": uuid.uuid4().hex.encode()}
    body = b'{"id": "pay-1", "amount": "12.50"}'
    first = await charge.process(ConsumerMessage(body, key))
    again = await charge.process(ConsumerMessage(body, key))
    # the duplicate gets a Receipt back, equal to the first: not a dict
    assert isinstance(again.result, Receipt) and again.result == first.result
    assert again.result.amount == Decimal("12.50")
    assert counts == {"executed": 1, "replayed": 1}
    print(f"{again.result!r} {dict(counts)}")
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
