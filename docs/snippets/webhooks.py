"""Webhooks: verify the signature on the raw body, then process each event
once."""

# --8<-- [start:receiver]
import os
from typing import Any

import asyncpg
from fastapi import FastAPI

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, stripe_verifier

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "whsec_test_docs")
store = PostgresStore.from_dsn(DSN)  # its pool opens on first use


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # once per (provider, event id); commits with the dedupe record
    amount = event["data"]["object"]["amount"]
    await conn.execute(
        "INSERT INTO payouts VALUES ($1, $2)", event["id"], amount
    )


app = FastAPI()
receiver = WebhookReceiver(store, "stripe", stripe_verifier([SECRET]), on_event)
app.add_api_route("/webhooks/stripe", receiver.handle, methods=["POST"])
# Starlette: Route("/webhooks/stripe", receiver.handle, methods=["POST"])
# --8<-- [end:receiver]


async def main() -> None:
    import json
    import time
    import uuid

    import httpx

    from consumer_idem.webhooks import sign_stripe

    await store.migrate()
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS payouts (event_id text, amount int)"
    )
    event_id = f"evt_{uuid.uuid4().hex[:12]}"
    event = {"id": event_id, "data": {"object": {"amount": 4200}}}
    body = json.dumps(event).encode()
    signature = {
        "Stripe-Signature": sign_stripe(body, SECRET, int(time.time()))
    }
    forged = {"Stripe-Signature": "t=1,v1=00"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        # the provider retries: the second is answered, not processed
        for _ in range(2):
            response = await client.post(
                "/webhooks/stripe", content=body, headers=signature
            )
            print(response.status_code, response.json())
            assert response.status_code == 200
        refused = await client.post(
            "/webhooks/stripe", content=body, headers=forged
        )
        assert refused.status_code == 401
    rows = await store.pool.fetchval(
        "SELECT count(*) FROM payouts WHERE event_id = $1", event_id
    )
    assert rows == 1
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
