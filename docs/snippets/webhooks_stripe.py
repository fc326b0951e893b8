"""Receiving Stripe: verified, each event run once, kept past the retries."""

import asyncio
import json
import os
import time
import uuid
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, sign_stripe, stripe_verifier

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Dashboard > Developers > Webhooks > your endpoint > Signing secret (whsec_...)
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get("STRIPE_WEBHOOK_SECRETS", "whsec_docs_example").split(
    ","
)


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per Stripe event id; the row commits with the dedupe record
    ref = event["id"]
    await conn.execute("INSERT INTO docs_stripe_charges VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_stripe_charges (ref text)"
    )
    receiver = WebhookReceiver(
        store, "stripe", stripe_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/stripe", receiver.handle, methods=["POST"])]
    )

    # what Stripe sends, signed with the first secret, delivered twice (a retry)
    ref = f"evt_{uuid.uuid4().hex}"
    body = json.dumps({"id": ref, "type": "charge.succeeded"}).encode()
    headers = {
        "Stripe-Signature": sign_stripe(body, SECRETS[0], int(time.time()))
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/stripe", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/stripe", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_stripe_charges WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
