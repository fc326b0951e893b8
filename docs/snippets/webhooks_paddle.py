"""Receiving Paddle: verified, each event run once, kept past the retries."""

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
from consumer_idem.webhooks import WebhookReceiver, paddle_verifier, sign_paddle

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Paddle > Developer tools > Notifications > your destination: the secret key
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get(
    "PADDLE_WEBHOOK_SECRETS", "pdl_ntfset_docs_secret"
).split(",")


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per Paddle event_id; the row commits with the dedupe record
    ref = event["data"]["id"]
    await conn.execute("INSERT INTO docs_paddle_transactions VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_paddle_transactions (ref text)"
    )
    receiver = WebhookReceiver(
        store, "paddle", paddle_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/paddle", receiver.handle, methods=["POST"])]
    )

    # what Paddle sends, signed with the first secret, delivered twice (a retry)
    ref = f"txn_{uuid.uuid4().hex}"
    event = {
        "event_id": f"evt_{uuid.uuid4().hex}",
        "event_type": "transaction.completed",
    }
    body = json.dumps({**event, "data": {"id": ref}}).encode()
    headers = sign_paddle(body, SECRETS[0], int(time.time()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/paddle", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/paddle", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_paddle_transactions WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
