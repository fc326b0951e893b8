"""Toss Payments webhooks: signed payout events verified, unsigned payment
events re-read."""

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, sign_toss, toss_verifier

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Developer Center > your shop > Webhooks:
# the security key of payout/seller webhooks.
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get(
    "TOSS_WEBHOOK_SECRETS", "docs-toss-security-key"
).split(",")
#: a stand-in for Toss's payments API
#: (GET /v1/payments/{paymentKey}, with your secret key)
PAYMENTS = {
    "pay_docs": {
        "paymentKey": "pay_docs",
        "status": "DONE",
        "totalAmount": 15000,
    }
}


async def fetch_payment(payment_key: str) -> dict[str, Any]:
    # In production: an authenticated GET of
    # https://api.tosspayments.com/v1/payments/{key}
    return PAYMENTS[payment_key]


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # A payment event's data is what Toss answered fetch_payment,
    # not what was posted.
    data = event["data"]
    ref = data.get("payoutKey") or f"{data['paymentKey']}:{data['status']}"
    await conn.execute("INSERT INTO docs_toss_events VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS docs_toss_events (ref text)")
    verifier = toss_verifier(SECRETS, fetch_payment=fetch_payment)
    receiver = WebhookReceiver(store, "toss", verifier, on_event)
    app = Starlette(
        routes=[Route("/webhooks/toss", receiver.handle, methods=["POST"])]
    )

    payout = f"payout_{uuid.uuid4().hex[:12]}"
    now = datetime.now(UTC).isoformat()
    signed = json.dumps(
        {
            "eventType": "payout.changed",
            "createdAt": now,
            "data": {"payoutKey": payout},
        }
    ).encode()
    headers = sign_toss(signed, SECRETS[0], now)
    unsigned = json.dumps(
        {
            "eventType": "PAYMENT_STATUS_CHANGED",
            "createdAt": now,
            "data": PAYMENTS["pay_docs"],
        }
    ).encode()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):  # each delivered twice (a retry)
            response = await client.post(
                "/webhooks/toss", content=signed, headers=headers
            )
            assert response.status_code == 200, response.text
            response = await client.post("/webhooks/toss", content=unsigned)
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/toss", content=signed + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    count = "SELECT count(*) FROM docs_toss_events WHERE ref = $1"
    assert await pool.fetchval(count, payout) == 1
    assert await pool.fetchval(count, "pay_docs:DONE") >= 1  # once per database
    await pool.close()


asyncio.run(main())
