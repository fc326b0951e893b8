"""Webhooks: verify the signature on the raw body, then process each event once."""

import asyncio
import json
import os
import time
import uuid
from typing import Any

import asyncpg
import httpx
from fastapi import FastAPI

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, sign_stripe, stripe_verifier

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "whsec_test_docs")


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS payouts (event_id text, amount int)")

    # --8<-- [start:receiver]
    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        # once per (provider, event id); commits with the dedupe record
        amount = event["data"]["object"]["amount"]
        await conn.execute("INSERT INTO payouts VALUES ($1, $2)", event["id"], amount)

    app = FastAPI()
    receiver = WebhookReceiver(store, "stripe", stripe_verifier([SECRET]), on_event)
    app.add_api_route("/webhooks/stripe", receiver.handle, methods=["POST"])
    # Starlette: Route("/webhooks/stripe", receiver.handle, methods=["POST"])
    # --8<-- [end:receiver]

    event = {"id": f"evt_{uuid.uuid4().hex[:12]}", "data": {"object": {"amount": 4200}}}
    body = json.dumps(event).encode()
    signature = {"Stripe-Signature": sign_stripe(body, SECRET, int(time.time()))}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://hooks") as client:
        for _ in range(2):  # the provider retries: the second is answered, not processed
            response = await client.post("/webhooks/stripe", content=body, headers=signature)
            print(response.status_code, response.json())
            assert response.status_code == 200
        forged = await client.post(
            "/webhooks/stripe", content=body, headers={"Stripe-Signature": "t=1,v1=00"}
        )
        assert forged.status_code == 401
    rows = await pool.fetchval("SELECT count(*) FROM payouts WHERE event_id = $1", event["id"])
    assert rows == 1
    await pool.close()


asyncio.run(main())
