"""Payment-gateway webhooks from ten senders, each event's effect once.

Run: ``uvicorn examples.gateway_webhooks:app``. ``POST /webhooks/{sender}`` for ``stripe``,
``standard``, ``razorpay``, ``checkout``, ``shopify``, ``github``, ``paddle``, ``adyen``,
``paypal``, ``toss``.

Configuration (environment):

* ``CONSUMER_IDEM_WEBHOOK_SECRET_<SENDER>``: the sender's secret; several, comma-separated,
  while one is rotated (Adyen's HMAC keys as hex, Standard Webhooks' as ``whsec_...``). A
  sender without one is not mounted; a secret that cannot work stops the start-up.
* ``CONSUMER_IDEM_PAYPAL_WEBHOOK_ID`` (comma-separated for several) and
  ``CONSUMER_IDEM_PAYPAL_CERT_FILE``, the PEM certificate returned for any ``PAYPAL-CERT-URL``
  on PayPal's hosts (a real deployment fetches it over HTTPS instead).
* ``CONSUMER_IDEM_PG_DSN``, ``CONSUMER_IDEM_SCHEMA``: the store.

Each accepted event (each item of an Adyen batch) inserts one row into
``webhook_events(sender, event_id, body)`` in its idempotency transaction: a retried event is
answered without a second row. Unsigned Toss payment events need a ``fetch_payment`` that
re-reads the payment from Toss; this example has none, so it refuses them (401).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem import webhooks as wh

SENDERS = (
    "stripe",
    "standard",
    "razorpay",
    "checkout",
    "shopify",
    "github",
    "paddle",
    "adyen",
    "paypal",
    "toss",
)
EVENTS_TABLE = """
CREATE TABLE IF NOT EXISTS webhook_events (sender text NOT NULL, event_id text NOT NULL,
                                           body jsonb NOT NULL)
"""
HMAC_VERIFIERS = {
    "stripe": wh.stripe_verifier,
    "standard": wh.standard_verifier,
    "razorpay": wh.razorpay_verifier,
    "checkout": wh.checkout_verifier,
    "shopify": wh.shopify_verifier,
    "github": wh.github_verifier,
    "paddle": wh.paddle_verifier,
    "adyen": wh.adyen_verifier,
    "toss": wh.toss_verifier,
}


def listed(name: str) -> list[str]:
    """A comma-separated environment variable as a list (empty: not set)."""
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def paypal() -> Any | None:
    webhook_ids = listed("CONSUMER_IDEM_PAYPAL_WEBHOOK_ID")
    cert_file = os.environ.get("CONSUMER_IDEM_PAYPAL_CERT_FILE")
    if not webhook_ids or not cert_file:
        return None
    pem = Path(cert_file).read_bytes()  # read now: a missing file stops the start-up

    async def fetch_certificate(url: str) -> bytes:
        return pem  # called only for a URL on PayPal's hosts, once per URL

    return wh.paypal_verifier(webhook_ids, fetch_certificate)


def verifier_for(sender: str) -> Any | None:
    """The sender's verifier, or None when it is not configured."""
    if sender == "paypal":
        return paypal()
    secrets = listed(f"CONSUMER_IDEM_WEBHOOK_SECRET_{sender.upper()}")
    return HMAC_VERIFIERS[sender](secrets) if secrets else None


def without_nul(value: Any) -> Any:
    """``value`` with U+0000 in its strings made U+FFFD: a jsonb column refuses U+0000, and
    a customer's text can hold it (refused, the event would be answered 500 on every retry)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


class Gateway:
    """The store, created at start-up, and a receiver per configured sender."""

    def __init__(self) -> None:
        self._store: PostgresStore | None = None
        self.receivers: dict[str, wh.WebhookReceiver] = {}
        for sender in SENDERS:
            verifier = verifier_for(sender)
            if verifier is not None:
                self.receivers[sender] = wh.WebhookReceiver(
                    self.store_now, sender, verifier, self.recorder(sender), with_delivery=True
                )

    def store_now(self) -> PostgresStore:
        assert self._store is not None, "the store is created at start-up"
        return self._store

    @staticmethod
    def recorder(sender: str) -> wh.DeliveryHandler:
        async def record(delivery: wh.Delivery, conn: asyncpg.Connection) -> None:
            # on the idempotency transaction's connection: commits with the event's record
            await conn.execute(
                "INSERT INTO webhook_events (sender, event_id, body) VALUES ($1, $2, $3::jsonb)",
                sender,
                delivery.event_id,
                json.dumps(without_nul(delivery.event)),
            )

        return record

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        dsn = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/")
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=10)
        try:
            schema = os.environ.get("CONSUMER_IDEM_SCHEMA", "consumer_idem")
            self._store = PostgresStore(pool, schema=schema)
            await self._store.migrate()
            await pool.execute(EVENTS_TABLE)
            yield
        finally:
            await pool.close()


gateway = Gateway()
app = Starlette(
    routes=[
        Route(f"/webhooks/{sender}", receiver.handle, methods=["POST"])
        for sender, receiver in gateway.receivers.items()
    ],
    lifespan=gateway.lifespan,
)
