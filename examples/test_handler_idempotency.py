"""Testing your handler: is this payments ledger handler safe under duplicates
and crashes?

    pip install 'consumer-idem[testing]'
    pytest test_handler_idempotency.py

No configuration: the kit's pytest plugin runs these async tests and finds a
PostgreSQL (``CONSUMER_IDEM_PG_DSN``, else a container, else an embedded one).
``make test`` runs this file so, in a new pytest project
(``scripts/wheel-testing``) and from this repository
(``tests/test_testing_kit.py``).
"""

from __future__ import annotations

import json
import uuid

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.testing import assert_idempotent

TABLES = """
CREATE TABLE IF NOT EXISTS demo_ledger (
    payment_id text NOT NULL,
    customer_id text NOT NULL,
    amount_cents bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS demo_accounts (
    customer_id text PRIMARY KEY, balance_cents bigint NOT NULL
);
"""
LEDGER_ROW = "INSERT INTO demo_ledger VALUES ($1, $2, $3)"
CREDIT = (
    "INSERT INTO demo_accounts VALUES ($1, $2) ON CONFLICT (customer_id)"
    " DO UPDATE SET balance_cents = demo_accounts.balance_cents + $2"
)
LEDGER_ROWS = "SELECT count(*) FROM demo_ledger WHERE payment_id = $1"
BALANCE = "SELECT balance_cents FROM demo_accounts WHERE customer_id = $1"


async def record_payment(
    message: ConsumerMessage,
    conn: asyncpg.Connection,
) -> None:
    """The handler under test: a ledger row and the customer's balance, both
    written on ``conn``, the connection of the idempotency transaction."""
    payment = message.json()
    customer, amount = payment["customer_id"], payment["amount_cents"]
    await conn.execute(LEDGER_ROW, payment["payment_id"], customer, amount)
    await conn.execute(CREDIT, customer, amount)


def new_payment() -> ConsumerMessage:
    """A fresh message: a new payment, with a new idempotency key, each call."""
    payment_id = f"pay_{uuid.uuid4().hex[:12]}"
    body = {
        "payment_id": payment_id,
        "customer_id": f"cus_{payment_id}",
        "amount_cents": 1250,
        "currency": "EUR",
    }
    headers = {"idempotency-key": payment_id.encode()}
    return ConsumerMessage(json.dumps(body).encode(), headers)


async def booked(
    conn: asyncpg.Connection,
    message: ConsumerMessage,
) -> tuple[int, int]:
    """The handler's effect for one payment: its ledger rows and its
    customer's balance."""
    payment = message.json()
    rows = await conn.fetchval(LEDGER_ROWS, payment["payment_id"])
    balance = await conn.fetchval(BALANCE, payment["customer_id"])
    return rows, balance or 0


async def test_the_ledger_handler_is_idempotent(
    idem_store: PostgresStore,
) -> None:
    # in the fixture's schema, dropped with it
    await idem_store.pool.execute(TABLES)
    key = header("idempotency-key")
    decorate = idempotent_consumer(idem_store, scope="payments.ledger", key=key)
    consumer = decorate(record_payment)
    # duplicates, concurrent duplicates, a crash before and after the commit,
    # a rolled-back commit, a lost lease...: each must leave what one clean
    # delivery leaves, (1, 1250)
    report = await assert_idempotent(consumer, new_payment, booked)
    assert report.clean_effect == (1, 1250)
