"""Testing your handlers: is the payments ledger handler safe under duplicates
and crashes?

    CONSUMER_IDEM_PG_DSN=postgresql://postgres:postgres@127.0.0.1/postgres \
        pytest examples/test_handler_idempotency.py

The testing guide's example; ``tests/test_testing_kit.py`` runs it as a user
would (the fixture comes from the installed plugin), so it cannot rot.
"""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest

from consumer_idem import ConsumerMessage, PostgresStore
from consumer_idem.testing import assert_idempotent
from handlers.payments import ensure_tables, ledger_consumer


def new_payment() -> ConsumerMessage:
    """A fresh message: a new payment, with a new idempotency key, each call."""
    payment_id = f"pay_{uuid.uuid4().hex[:12]}"
    body = {
        "payment_id": payment_id,
        "customer_id": f"cus_{payment_id}",
        "amount_cents": 1250,
        "currency": "EUR",
    }
    return ConsumerMessage(
        json.dumps(body).encode(),
        {"idempotency-key": payment_id.encode()},
    )


async def booked(
    conn: asyncpg.Connection,
    message: ConsumerMessage,
) -> tuple[int, int]:
    """The handler's effect for one payment: its ledger rows and its
    customer's balance."""
    payment = message.json()
    rows = await conn.fetchval(
        "SELECT count(*) FROM demo_ledger WHERE payment_id = $1",
        payment["payment_id"],
    )
    balance = await conn.fetchval(
        "SELECT balance_cents FROM demo_accounts WHERE customer_id = $1",
        payment["customer_id"],
    )
    return rows, balance or 0


@pytest.mark.parametrize("batch", [False, True])
async def test_the_ledger_handler_is_idempotent(
    idem_store: PostgresStore,
    batch: bool,
) -> None:
    # in the fixture's schema, dropped with it
    await ensure_tables(idem_store.pool)
    consumer = ledger_consumer(idem_store, batch=batch)
    # duplicates, concurrent duplicates, a crash before and after the commit,
    # a rolled-back commit, a lost lease...: each must leave what one clean
    # delivery leaves, (1, 1250)
    report = await assert_idempotent(consumer, new_payment, booked)
    assert report.clean_effect == (1, 1250)
