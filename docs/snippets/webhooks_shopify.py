"""Receiving Shopify: verified, each event run once, kept past the retries."""

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
    shopify_verifier,
    sign_shopify,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Partner Dashboard > your app > Client credentials: the client secret
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get("SHOPIFY_CLIENT_SECRETS", "docs-shopify-secret").split(
    ","
)


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per X-Shopify-Webhook-Id header;
    # the row commits with the dedupe record
    ref = str(event["id"])
    await conn.execute("INSERT INTO docs_shopify_orders VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_shopify_orders (ref text)"
    )
    receiver = WebhookReceiver(
        store, "shopify", shopify_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/shopify", receiver.handle, methods=["POST"])]
    )

    # what Shopify sends, signed with the first secret,
    # delivered twice (a retry)
    ref = str(uuid.uuid4().int % 10**18)
    body = json.dumps({"id": int(ref), "total_price": "10.00"}).encode()
    headers = sign_shopify(body, SECRETS[0], str(uuid.uuid4()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/shopify", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/shopify", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_shopify_orders WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
