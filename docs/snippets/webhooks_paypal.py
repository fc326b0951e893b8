"""PayPal: the RSA signature verified offline with PayPal's certificate."""

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, paypal_verifier, sign_paypal

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Developer Dashboard > Apps & Credentials > your app > Webhooks:
# the webhook's ID.
# Several, comma-separated, while you move to a new webhook.
WEBHOOK_IDS = os.environ.get("PAYPAL_WEBHOOK_IDS", "1JE4291016473214C").split(
    ","
)

# A stand-in for PayPal's signing key and certificate, so that this program
# runs offline.
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
NAME = x509.Name(
    [x509.NameAttribute(NameOID.COMMON_NAME, "stand-in for PayPal")]
)
NOW = datetime.now(UTC)
CERT = (
    x509.CertificateBuilder()
    .subject_name(NAME)
    .issuer_name(NAME)
    .public_key(KEY.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(NOW - timedelta(days=1))
    .not_valid_after(NOW + timedelta(days=30))
    .sign(KEY, hashes.SHA256())
)


# PayPal names its certificate in each transmission's PAYPAL-CERT-URL header
CERT_URL = "https://api.paypal.com/v1/notifications/certs/CERT-360caa42"


async def fetch_certificate(url: str) -> bytes:
    # In production: an HTTPS GET of url (httpx.AsyncClient().get(url).content).
    # Only URLs on PayPal's hosts reach this function, and each is fetched once,
    # then cached.
    return CERT.public_bytes(serialization.Encoding.PEM)


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per PayPal event id (WH-...),
    # however many transmissions carry it
    await conn.execute(
        "INSERT INTO docs_paypal_events VALUES ($1)", event["id"]
    )


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_paypal_events (ref text)"
    )
    verifier = paypal_verifier(WEBHOOK_IDS, fetch_certificate)
    receiver = WebhookReceiver(store, "paypal", verifier, on_event)
    app = Starlette(
        routes=[Route("/webhooks/paypal", receiver.handle, methods=["POST"])]
    )

    ref = f"WH-{uuid.uuid4().hex[:20].upper()}"
    body = json.dumps(
        {"id": ref, "event_type": "PAYMENT.CAPTURE.COMPLETED"}
    ).encode()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        # PayPal retries: a new transmission of the same event
        for _ in range(2):
            headers = sign_paypal(
                body,
                KEY,
                webhook_id=WEBHOOK_IDS[0],
                transmission_id=str(uuid.uuid4()),
                transmission_time=datetime.now(UTC).isoformat(),
                cert_url=CERT_URL,
            )
            response = await client.post(
                "/webhooks/paypal", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/paypal", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_paypal_events WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
