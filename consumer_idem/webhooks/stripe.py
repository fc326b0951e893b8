"""Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>]``, HMAC-SHA256 of ``"{t}.{raw body}"``
with the endpoint's signing secret (``whsec_...``, used as text), hex; 300 s tolerance. Several
``v1`` entries appear while Stripe rolls a secret. The identity is the event's ``id``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from consumer_idem.errors import WebhookVerificationError
from consumer_idem.webhooks._verify import (
    DEFAULT_TOLERANCE,
    HmacVerifier,
    Scheme,
    field_identity,
    hmac_sha256,
)


def _split(value: str) -> tuple[str | None, list[str]]:
    pairs = [part.split("=", 1) for part in value.split(",") if "=" in part]
    timestamps = [v.strip() for k, v in pairs if k.strip() == "t"]
    if len(timestamps) != 1:
        raise WebhookVerificationError(400, "Stripe-Signature needs one t= and a v1=")
    return timestamps[0], [v.strip() for k, v in pairs if k.strip() == "v1"]


def _signed(body: bytes, timestamp: str | None, headers: Mapping[str, str]) -> bytes:
    return f"{timestamp}.".encode() + body


STRIPE = Scheme(
    sender="stripe",
    header="stripe-signature",
    split=_split,
    template=_signed,
    encoding="hex",
    timestamp="unix",
    identity=field_identity("id", "Stripe event"),
)


def stripe_verifier(secrets: Sequence[str], tolerance: float = DEFAULT_TOLERANCE) -> HmacVerifier:
    """A Stripe verifier for one or more signing secrets (rotation)."""
    return HmacVerifier(STRIPE, secrets, tolerance=tolerance)


def verify_stripe(
    payload: bytes,
    header: str | None,
    secrets: Sequence[str],
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> int:
    """Verify a ``Stripe-Signature`` header; returns its timestamp."""
    headers = {} if header is None else {"stripe-signature": header}
    stripe_verifier(secrets, tolerance).check(payload, headers, now)
    return int(_split(header or "")[0] or 0)


def sign_stripe(payload: bytes, secret: str, timestamp: int) -> str:
    """A ``Stripe-Signature`` header value (for tests and local tools)."""
    signature = hmac_sha256(secret.encode(), f"{timestamp}.".encode() + payload, "hex")
    return f"t={timestamp},v1={signature}"
