"""Receiving Checkout.com: verified, each event run once, past the retries."""

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
    checkout_verifier,
    sign_checkout,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Dashboard > Developers > Webhooks (workflows): the secret key of the webhook
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get(
    "CHECKOUT_WEBHOOK_SECRETS", "docs-checkout-secret"
).split(",")


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per Checkout.com event id; the row commits with the dedupe
    # record
    ref = event["id"]
    await conn.execute("INSERT INTO docs_checkout_events VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_checkout_events (ref text)"
    )
    receiver = WebhookReceiver(
        store, "checkout", checkout_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/checkout", receiver.handle, methods=["POST"])]
    )

    # what Checkout.com sends, signed with the first secret,
    # delivered twice (a retry)
    ref = f"evt_{uuid.uuid4().hex}"
    body = json.dumps(
        {"id": ref, "type": "payment_captured", "data": {"amount": 1000}}
    ).encode()
    headers = sign_checkout(body, SECRETS[0])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/checkout", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/checkout", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_checkout_events WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
