"""The reference payments handlers under the testing kit (``consumer_idem.testing``).

The ledger handler (``handlers/payments.py``, transactional, one by one and in batches) must
pass every scenario; the gateway handler (``handlers/gateway.py``, two-phase, against the real
stand-in gateway with a resolver that asks it) every scenario whose outcome is not reconciled
"executed" (then the completion's local row is not written: see
``test_testing_kit.test_two_phase_local_writes_and_a_reconciled_outcome``).
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from consumer_idem import (
    Attempt,
    ConsumerMessage,
    Executed,
    NotExecuted,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.testing import ExternalCall, assert_idempotent, scenario_names
from consumer_idem.types import Record
from examples.test_handler_idempotency import booked, new_payment
from handlers.gateway import CHARGES_SQL, GatewayClient, charge_handler, record_charge
from handlers.payments import ensure_tables, ledger_consumer


@pytest.mark.parametrize("batch", [False, True], ids=["one-by-one", "batch"])
async def test_the_ledger_handler_passes_every_scenario(
    idem_store: PostgresStore, batch: bool
) -> None:
    await ensure_tables(idem_store.pool)
    consumer = ledger_consumer(idem_store, batch=batch)
    report = await assert_idempotent(consumer, new_payment, booked)
    assert report.clean_effect == (1, 1250)
    assert report.passed == scenario_names(consumer) and not report.not_applicable


_ANY_TOKEN = uuid.UUID(int=0)  # the downstream key does not depend on the token


async def test_the_gateway_handler_charges_once(
    idem_store: PostgresStore, gateway_url: str
) -> None:
    await idem_store.pool.execute(CHARGES_SQL)
    client = GatewayClient(gateway_url, timeout=2.0)
    http = httpx.AsyncClient(base_url=gateway_url)
    consumer = idempotent_consumer(
        idem_store,
        scope="payments.gateway",
        key=header("idempotency-key"),
        mode="two_phase",
        local_writes=record_charge,
    )(charge_handler(client))

    def downstream_key(key: str) -> str:
        return Attempt("payments.gateway", key, _ANY_TOKEN, 1).downstream_key

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> tuple[int, int]:
        """Whether the gateway holds the charge, and our local rows of it."""
        payment_id = message.json()["payment_id"]  # also its idempotency key (new_payment)
        found = await http.get(f"/charges/{downstream_key(payment_id)}")
        local = await conn.fetchval(
            "SELECT count(*) FROM demo_charges WHERE payment_id = $1", payment_id
        )
        return int(found.status_code == 200), local

    async def ask_the_gateway(record: Record) -> Executed | NotExecuted:
        """The operator's resolver: the gateway knows the charge by its idempotency key."""
        found = await http.get(f"/charges/{downstream_key(record.key)}")
        if found.status_code == 404:
            return NotExecuted("the gateway has no such charge")
        charge: dict[str, Any] = found.json()
        # the result the handler would have returned (the key is the payment id)
        return Executed({"payment_id": record.key, **charge})

    # the request reaches the gateway and charges, then its answer times out: the reference
    # handler must park it unknown (Ambiguous), never send it again blindly
    post = ExternalCall(client.http.post, failure=lambda: httpx.ReadTimeout("answer lost"))
    client.http.post = post  # type: ignore[method-assign]
    try:
        report = await assert_idempotent(
            consumer,
            new_payment,
            charged,
            resolver=ask_the_gateway,
            external=post,
        )
    finally:
        await client.aclose()
        await http.aclose()
    assert report.clean_effect == (1, 1)
    assert "crash before commit" in report.passed and "lease lost" in " ".join(report.passed)
    assert "the call took effect, then failed" in report.passed and len(post.raised) == 1
