"""Checkout.com: ``Cko-Signature``, HMAC-SHA256 of the raw body with the webhook's secret key,
hex; no timestamp. The identity is the event's ``id`` (``evt_...``)."""

from __future__ import annotations

from collections.abc import Sequence

from consumer_idem.webhooks._verify import (
    HmacVerifier,
    Scheme,
    bare_signature,
    field_identity,
    hmac_sha256,
    raw_body,
)

CHECKOUT = Scheme(
    sender="checkout",
    header="cko-signature",
    split=bare_signature,
    template=raw_body,
    encoding="hex",
    identity=field_identity("id", "Checkout.com event"),
)


def checkout_verifier(secrets: Sequence[str]) -> HmacVerifier:
    """A Checkout.com verifier for one or more webhook secret keys (rotation)."""
    return HmacVerifier(CHECKOUT, secrets)


def sign_checkout(payload: bytes, secret: str) -> dict[str, str]:
    """The header Checkout.com sends with ``payload`` (for tests and local tools)."""
    return {"cko-signature": hmac_sha256(secret.encode(), payload, "hex")}
