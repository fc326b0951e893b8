"""Razorpay: ``X-Razorpay-Signature``, HMAC-SHA256 of the raw body with the webhook secret you
set in the Dashboard, hex; no timestamp. The identity is the ``x-razorpay-event-id`` header."""

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

RAZORPAY = Scheme(
    sender="razorpay",
    header="x-razorpay-signature",
    split=bare_signature,
    template=raw_body,
    encoding="hex",
    identity=header_identity("x-razorpay-event-id"),
)


def razorpay_verifier(secrets: Sequence[str]) -> HmacVerifier:
    """A Razorpay verifier for one or more webhook secrets (rotation)."""
    return HmacVerifier(RAZORPAY, secrets)


def sign_razorpay(payload: bytes, secret: str, event_id: str) -> dict[str, str]:
    """The headers Razorpay sends with ``payload`` (for tests and local tools)."""
    return {
        "x-razorpay-signature": hmac_sha256(secret.encode(), payload, "hex"),
        "x-razorpay-event-id": event_id,
    }
