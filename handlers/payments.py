"""Reference payments handlers used by the demo: a ledger write in transactional mode.

Each payment request is JSON ``{"payment_id", "customer_id", "amount_cents", "currency"}``. The
effect is one row in ``demo_ledger`` (append-only, deliberately without a unique constraint, so a
duplicate effect would show) and ``amount_cents`` added to the customer's ``demo_accounts`` row,
in the same transaction as the idempotency record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PoisonMessage,
    PostgresStore,
    header,
    idempotent_consumer,
)

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS demo_ledger (
    id            bigserial PRIMARY KEY,
    payment_id    text        NOT NULL,
    customer_id   text        NOT NULL,
    amount_cents  bigint      NOT NULL,
    currency      text        NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS demo_ledger_payment ON demo_ledger (payment_id);
CREATE TABLE IF NOT EXISTS demo_accounts (
    customer_id    text PRIMARY KEY,
    balance_cents  bigint NOT NULL DEFAULT 0
);
"""


async def ensure_tables(conn: asyncpg.Connection | asyncpg.Pool) -> None:
    """Create the demo tables if missing (an advisory lock keeps concurrent starters apart)."""
    async with _acquire(conn) as c, c.transaction():
        await c.execute("SELECT pg_advisory_xact_lock(hashtextextended('demo_tables', 0))")
        await c.execute(SCHEMA_SQL)


class _acquire:  # a pool or a connection, used the same way
    def __init__(self, source: asyncpg.Connection | asyncpg.Pool) -> None:
        self.source = source
        self.ctx: Any = None

    async def __aenter__(self) -> Any:
        if isinstance(self.source, asyncpg.Pool):
            self.ctx = self.source.acquire()
            return await self.ctx.__aenter__()
        return self.source

    async def __aexit__(self, *exc: object) -> None:
        if self.ctx is not None:
            await self.ctx.__aexit__(*exc)


@dataclass(frozen=True, slots=True)
class Payment:
    payment_id: str
    customer_id: str
    amount_cents: int
    currency: str


def parse_payment(message: ConsumerMessage) -> Payment:
    """Validate a payment request; a malformed one is poison (dead-lettered, never retried)."""
    data = message.json()
    if not isinstance(data, dict):
        raise PoisonMessage("invalid_payment", "payment request must be a JSON object")
    try:
        payment = Payment(
            payment_id=str(data["payment_id"]),
            customer_id=str(data["customer_id"]),
            amount_cents=int(data["amount_cents"]),
            currency=str(data["currency"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PoisonMessage("invalid_payment", f"bad payment request: {exc!r}") from exc
    if len(payment.currency) != 3 or payment.amount_cents <= 0:
        raise PoisonMessage("invalid_payment", "currency must be ISO 4217, amount positive")
    return payment


INSERT_LEDGER = (
    "INSERT INTO demo_ledger (payment_id, customer_id, amount_cents, currency)"
    " VALUES ($1, $2, $3, $4)"
)
ADD_TO_BALANCE = (
    "INSERT INTO demo_accounts (customer_id, balance_cents) VALUES ($1, $2)"
    " ON CONFLICT (customer_id) DO UPDATE"
    " SET balance_cents = demo_accounts.balance_cents + EXCLUDED.balance_cents"
)


async def record_payment(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
    """One payment: ledger row + balance, on the idempotency transaction's connection."""
    p = parse_payment(message)
    await conn.execute(INSERT_LEDGER, p.payment_id, p.customer_id, p.amount_cents, p.currency)
    await conn.execute(ADD_TO_BALANCE, p.customer_id, p.amount_cents)


async def record_payments(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
    """Batch mode: the same effect for many payments with two set-based statements."""
    payments = [parse_payment(m) for m in messages]
    if not payments:
        return
    await conn.execute(
        "INSERT INTO demo_ledger (payment_id, customer_id, amount_cents, currency)"
        " SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[])",
        [p.payment_id for p in payments],
        [p.customer_id for p in payments],
        [p.amount_cents for p in payments],
        [p.currency for p in payments],
    )
    # sorted by customer: concurrent batches take the account row locks in one order (no deadlock)
    await conn.execute(
        "INSERT INTO demo_accounts (customer_id, balance_cents)"
        " SELECT c, sum(a) FROM unnest($1::text[], $2::bigint[]) AS u(c, a)"
        " GROUP BY c ORDER BY c"
        " ON CONFLICT (customer_id) DO UPDATE"
        " SET balance_cents = demo_accounts.balance_cents + EXCLUDED.balance_cents",
        [p.customer_id for p in payments],
        [p.amount_cents for p in payments],
    )


LEDGER_SCOPE = "payments.ledger"


def ledger_consumer(store: PostgresStore, *, batch: bool = False) -> IdempotentConsumer:
    """The demo's idempotent consumer; also the target of
    ``consumer-idem replay --handler handlers.payments:ledger_consumer``."""
    handler = record_payments if batch else record_payment
    return idempotent_consumer(
        store, scope=LEDGER_SCOPE, key=header("idempotency-key"), batch=batch
    )(handler)
