"""Receiving Standard Webhooks (Svix): verified, each event run once."""

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
from consumer_idem.webhooks import (
    WebhookReceiver,
    sign_standard,
    standard_verifier,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# your sender's endpoint settings: a whsec_<base64> signing secret
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get(
    "STANDARD_WEBHOOK_SECRETS", "whsec_ZG9jcy1zdGFuZGFyZC1zZWNyZXQ="
).split(",")


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per webhook-id header; the row commits with the dedupe record
    ref = event["data"]["id"]
    await conn.execute("INSERT INTO docs_standard_events VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_standard_events (ref text)"
    )
    receiver = WebhookReceiver(
        store, "standard", standard_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/standard", receiver.handle, methods=["POST"])]
    )

    # what Standard Webhooks (Svix) sends, signed with the first secret,
    # delivered twice (a retry)
    ref = f"inv_{uuid.uuid4().hex}"
    body = json.dumps({"type": "invoice.paid", "data": {"id": ref}}).encode()
    headers = sign_standard(
        body, SECRETS[0], f"msg_{uuid.uuid4().hex}", int(time.time())
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/standard", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/standard", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_standard_events WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
