"""Shopify: ``X-Shopify-Hmac-Sha256``, HMAC-SHA256 of the raw body with the app's client
secret, base64; no timestamp. The identity is the ``X-Shopify-Webhook-Id`` header."""

from __future__ import annotations

from collections.abc import Sequence

from consumer_idem.webhooks._verify import (
    HmacVerifier,
    Scheme,
    bare_signature,
    header_identity,
    hmac_sha256,
    raw_body,
)

SHOPIFY = Scheme(
    sender="shopify",
    header="x-shopify-hmac-sha256",
    split=bare_signature,
    template=raw_body,
    encoding="base64",
    identity=header_identity("x-shopify-webhook-id"),
)


def shopify_verifier(secrets: Sequence[str]) -> HmacVerifier:
    """A Shopify verifier for one or more client secrets (rotation)."""
    return HmacVerifier(SHOPIFY, secrets)


def sign_shopify(payload: bytes, secret: str, webhook_id: str) -> dict[str, str]:
    """The headers Shopify sends with ``payload`` (for tests and local tools)."""
    return {
        "x-shopify-hmac-sha256": hmac_sha256(secret.encode(), payload, "base64"),
        "x-shopify-webhook-id": webhook_id,
    }
