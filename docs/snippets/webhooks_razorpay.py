"""Receiving Razorpay: verified, each event run once, kept past the retries."""

import asyncio
import json
import os
import uuid
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.webhooks import (
    WebhookReceiver,
    razorpay_verifier,
    sign_razorpay,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Dashboard > Accounts & Settings > Webhooks:
# the secret you typed when adding the URL
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get(
    "RAZORPAY_WEBHOOK_SECRETS", "docs-razorpay-secret"
).split(",")


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per x-razorpay-event-id header;
    # the row commits with the dedupe record
    ref = event["payload"]["payment"]["entity"]["id"]
    await conn.execute("INSERT INTO docs_razorpay_payments VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_razorpay_payments (ref text)"
    )
    receiver = WebhookReceiver(
        store, "razorpay", razorpay_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/razorpay", receiver.handle, methods=["POST"])]
    )

    # what Razorpay sends, signed with the first secret,
    # delivered twice (a retry)
    ref = f"pay_{uuid.uuid4().hex[:14]}"
    payment = {"payment": {"entity": {"id": ref, "amount": 50000}}}
    body = json.dumps(
        {"event": "payment.captured", "payload": payment}
    ).encode()
    headers = sign_razorpay(body, SECRETS[0], f"evt_{uuid.uuid4().hex[:14]}")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/razorpay", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/razorpay", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_razorpay_payments WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
