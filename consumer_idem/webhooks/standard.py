"""Standard Webhooks (Svix): ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature: v1,<base64> [v1,<base64> ...]``; HMAC-SHA256 of ``"{id}.{timestamp}.{body}"``
with the base64 key of a ``whsec_<base64>`` secret; +-5 minutes. The identity is ``webhook-id``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence

from consumer_idem.errors import WebhookSecretError
from consumer_idem.webhooks._verify import (
    DEFAULT_TOLERANCE,
    HmacVerifier,
    Scheme,
    header_identity,
    hmac_sha256,
    one_header,
)


def standard_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret. The padding may be left out (as the
    reference implementation accepts); an empty key would let anyone sign, so it is refused."""
    encoded = secret.removeprefix("whsec_").rstrip("=")
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error as exc:
        raise WebhookSecretError("a Standard Webhooks secret is whsec_ + base64") from exc
    if not key:
        raise WebhookSecretError("the Standard Webhooks secret is empty: anyone could sign")
    return key


def _split(value: str) -> tuple[str | None, list[str]]:
    return None, [
        sig for version, _, sig in (e.partition(",") for e in value.split()) if version == "v1"
    ]


def _signed(body: bytes, timestamp: str | None, headers: Mapping[str, str]) -> bytes:
    return f"{one_header(headers, 'webhook-id')}.{timestamp}.".encode() + body


STANDARD = Scheme(
    sender="standard",
    header="webhook-signature",
    split=_split,
    template=_signed,
    encoding="base64",
    key=standard_key,
    timestamp="unix",
    timestamp_header="webhook-timestamp",
    identity=header_identity("webhook-id"),
)


def standard_verifier(secrets: Sequence[str], tolerance: float = DEFAULT_TOLERANCE) -> HmacVerifier:
    """A Standard Webhooks verifier; raises [`WebhookSecretError`][consumer_idem.WebhookSecretError]
    at once for a secret
    that cannot work (empty, not base64), instead of refusing every delivery later."""
    return HmacVerifier(STANDARD, secrets, tolerance=tolerance)


def verify_standard(
    payload: bytes,
    headers: Mapping[str, str],
    secrets: Sequence[str],
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> str:
    """Verify Standard Webhooks headers; returns the message id (``webhook-id``)."""
    standard_verifier(secrets, tolerance).check(payload, headers, now)
    return one_header(headers, "webhook-id")


def sign_standard(payload: bytes, secret: str, msg_id: str, timestamp: int) -> dict[str, str]:
    """Headers for a Standard Webhooks message (for senders, and for tests)."""
    signed = f"{msg_id}.{timestamp}.".encode() + payload
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": f"v1,{hmac_sha256(standard_key(secret), signed, 'base64')}",
    }
