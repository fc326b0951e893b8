"""Adyen: each item of a batch verified and run once, [accepted] after all."""

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
    adyen_batch,
    adyen_verifier,
    sign_adyen_item,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Customer Area > Developers > Webhooks > your Standard webhook > HMAC key
# (hexadecimal).
# Several, comma-separated, while you rotate: old and new are both accepted.
HMAC_KEYS = os.environ.get(
    "ADYEN_HMAC_KEYS", "44782DEF547AAA06C910C43932B1EB0C"
).split(",")


async def on_item(item: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per pspReference + eventCode + success;
    # it commits with the dedupe record
    await conn.execute(
        "INSERT INTO docs_adyen_events VALUES ($1, $2)",
        item["pspReference"],
        item["eventCode"],
    )


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_adyen_events (psp text, code text)"
    )
    receiver = WebhookReceiver(
        store, "adyen", adyen_verifier(HMAC_KEYS), on_item
    )
    app = Starlette(
        routes=[Route("/webhooks/adyen", receiver.handle, methods=["POST"])]
    )

    # a batch of two items as Adyen sends it, the first sent before on its own
    psp = uuid.uuid4().hex[:16].upper()
    items = [
        sign_adyen_item(
            {
                "pspReference": psp,
                "merchantAccountCode": "YourMerchantAccount",
                "merchantReference": "order-1",
                "amount": {"value": 1130, "currency": "EUR"},
                "eventCode": code,
                "success": "true",
            },
            HMAC_KEYS[0],
        )
        for code in ("AUTHORISATION", "CAPTURE")
    ]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for batch in (
            adyen_batch(items[0]),
            adyen_batch(*items),
            adyen_batch(*items),
        ):
            response = await client.post(
                "/webhooks/adyen", content=json.dumps(batch)
            )
            assert response.text == "[accepted]", response.text
    runs = await pool.fetchval(
        "SELECT count(*) FROM docs_adyen_events WHERE psp = $1", psp
    )
    assert runs == 2  # each item once, however often the batch came
    await pool.close()


asyncio.run(main())
