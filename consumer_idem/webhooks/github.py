"""GitHub (and senders signing the same way): ``X-Hub-Signature-256: sha256=<hex>``,
HMAC-SHA256 of the raw body with the webhook's secret; no timestamp. The identity is the
``X-GitHub-Delivery`` header (a redelivery keeps it)."""

from __future__ import annotations

from collections.abc import Sequence

from consumer_idem.errors import WebhookVerificationError
from consumer_idem.webhooks._verify import (
    HmacVerifier,
    Scheme,
    header_identity,
    hmac_sha256,
    raw_body,
)


def _split(value: str) -> tuple[str | None, list[str]]:
    algorithm, sep, signature = value.partition("=")
    if not sep or algorithm.strip() != "sha256":
        raise WebhookVerificationError(400, "X-Hub-Signature-256 is sha256=<hex>")
    return None, [signature]


GITHUB = Scheme(
    sender="github",
    header="x-hub-signature-256",
    split=_split,
    template=raw_body,
    encoding="hex",
    identity=header_identity("x-github-delivery"),
)


def github_verifier(secrets: Sequence[str]) -> HmacVerifier:
    """A GitHub-style verifier for one or more webhook secrets (rotation)."""
    return HmacVerifier(GITHUB, secrets)


def sign_github(payload: bytes, secret: str, delivery: str) -> dict[str, str]:
    """The headers GitHub sends with ``payload`` (for tests and local tools)."""
    return {
        "x-hub-signature-256": "sha256=" + hmac_sha256(secret.encode(), payload, "hex"),
        "x-github-delivery": delivery,
    }
