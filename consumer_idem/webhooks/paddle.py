"""Paddle Billing: ``Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>]``, HMAC-SHA256 of
``"{ts}:{raw body}"`` with the notification destination's secret key, hex; the timestamp is
signed (300 s tolerance by default; Paddle's SDKs use 5 s). Several ``h1`` appear while a
secret is rotated. The identity is the event's ``event_id``."""

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
    pairs = [part.split("=", 1) for part in value.split(";") if "=" in part]
    timestamps = [v.strip() for k, v in pairs if k.strip() == "ts"]
    if len(timestamps) != 1:
        raise WebhookVerificationError(400, "Paddle-Signature needs one ts= and an h1=")
    return timestamps[0], [v.strip() for k, v in pairs if k.strip() == "h1"]


def _signed(body: bytes, timestamp: str | None, headers: Mapping[str, str]) -> bytes:
    return f"{timestamp}:".encode() + body


PADDLE = Scheme(
    sender="paddle",
    header="paddle-signature",
    split=_split,
    template=_signed,
    encoding="hex",
    timestamp="unix",
    identity=field_identity("event_id", "Paddle event"),
)


def paddle_verifier(secrets: Sequence[str], tolerance: float = DEFAULT_TOLERANCE) -> HmacVerifier:
    """A Paddle verifier for one or more endpoint secret keys (rotation)."""
    return HmacVerifier(PADDLE, secrets, tolerance=tolerance)


def sign_paddle(payload: bytes, secret: str, timestamp: int) -> dict[str, str]:
    """The header Paddle sends with ``payload`` (for tests and local tools)."""
    signature = hmac_sha256(secret.encode(), f"{timestamp}:".encode() + payload, "hex")
    return {"paddle-signature": f"ts={timestamp};h1={signature}"}
