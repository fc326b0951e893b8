"""Adyen Standard notifications: a batch (``notificationItems``), each
``NotificationRequestItem`` signed on its own in ``additionalData.hmacSignature``: HMAC-SHA256
over ``pspReference:originalReference:merchantAccountCode:merchantReference:value:currency:
eventCode:success`` (each field with ``\\`` and ``:`` escaped, empty fields kept), with the
hex-decoded HMAC key, base64. No timestamp. The receiver answers ``[accepted]``.

Every item must verify, or the whole batch is refused (401) and nothing runs. Each item is then
its own event, deduplicated by ``pspReference`` + ``eventCode`` + ``success``: an item already
processed replays while the batch's others run, and the batch is accepted only after every
item's effect is committed (a failure on one item answers 500: Adyen resends the batch, and
the items already committed replay).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from consumer_idem.errors import WebhookVerificationError
from consumer_idem.fingerprint import fingerprint_bytes
from consumer_idem.webhooks._verify import (
    decode_digest,
    hex_key,
    hmac_sha256,
    json_object,
    matches,
    secret_keys,
)
from consumer_idem.webhooks.receiver import Delivery

#: the signed fields, in the order they are signed (``amount.value``: a nested field)
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "amount.value",
    "amount.currency",
    "eventCode",
    "success",
)


def _field(item: Mapping[str, Any], path: str) -> str:
    value: Any = item
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):  # JSON true/false: Adyen signs the text "true"/"false"
        return "true" if value else "false"
    return str(value)


def _escaped(item: Mapping[str, Any], path: str) -> str:
    return _field(item, path).replace("\\", "\\\\").replace(":", "\\:")


def signing_string(item: Mapping[str, Any]) -> bytes:
    """The bytes Adyen signs for one ``NotificationRequestItem``."""
    return ":".join(_escaped(item, f) for f in SIGNED_FIELDS).encode()


def item_identity(item: Mapping[str, Any]) -> str:
    """An item's identity: ``pspReference`` + ``eventCode`` + ``success`` (a refused and a
    succeeded authorisation of one payment are two events)."""
    # escaped as in the signing string: "A:B" + "C" and "A" + "B:C" are two events
    psp, code = _escaped(item, "pspReference"), _escaped(item, "eventCode")
    if not psp or not code:
        raise WebhookVerificationError(400, "an Adyen item has no pspReference or eventCode")
    return f"{psp}:{code}:{_escaped(item, 'success')}"


def batch_items(body: bytes) -> list[dict[str, Any]]:
    """The ``NotificationRequestItem`` objects of a batch, or a 400 naming what is wrong."""
    batch = json_object(body)
    wrapped = batch.get("notificationItems")
    if not isinstance(wrapped, list) or not wrapped:
        raise WebhookVerificationError(400, "the Adyen batch has no notificationItems list")
    items = [w.get("NotificationRequestItem") if isinstance(w, dict) else None for w in wrapped]
    if not all(isinstance(item, dict) for item in items):
        raise WebhookVerificationError(400, "an Adyen notificationItem is no object")
    return items  # type: ignore[return-value]


class AdyenVerifier:
    """Verifies every item of an Adyen batch with any of several hex HMAC keys (rotation)."""

    sender = "adyen"

    def __init__(self, hmac_keys: Sequence[str]) -> None:
        self._keys = secret_keys(hmac_keys, hex_key, "Adyen HMAC")

    def verify_item(self, item: Mapping[str, Any]) -> None:
        extra = item.get("additionalData")
        signature = extra.get("hmacSignature") if isinstance(extra, Mapping) else None
        if isinstance(signature, list):
            raise WebhookVerificationError(400, "an Adyen hmacSignature is sent more than once")
        if not isinstance(signature, str) or not signature:
            raise WebhookVerificationError(400, "an Adyen item has no additionalData.hmacSignature")
        digest = decode_digest(signature, "base64")
        if not matches(signing_string(item), self._keys, [digest] if digest else []):
            raise WebhookVerificationError(401, "an Adyen item's signature does not match")

    async def deliveries(self, body: bytes, headers: Mapping[str, str]) -> list[Delivery]:
        items = batch_items(body)
        for item in items:  # all verify before any runs: a forged item refuses the batch
            self.verify_item(item)
        # the fingerprint is what is signed: a resend after a key rotation carries another
        # hmacSignature, and the unsigned fields are anyone's to change (and may not
        # canonicalise): such a resend replays, never 422 or 500
        return [
            Delivery(item_identity(item), item, fingerprint_bytes(signing_string(item)))
            for item in items
        ]


def adyen_verifier(hmac_keys: Sequence[str]) -> AdyenVerifier:
    """An Adyen verifier for one or more hex HMAC keys (rotation)."""
    return AdyenVerifier(hmac_keys)


def sign_adyen_item(item: dict[str, Any], hmac_key: str) -> dict[str, Any]:
    """``item`` with its ``additionalData.hmacSignature`` set (for tests and local tools)."""
    signature = hmac_sha256(bytes.fromhex(hmac_key), signing_string(item), "base64")
    extra = {**item.get("additionalData", {}), "hmacSignature": signature}
    return {**item, "additionalData": extra}


def adyen_batch(*items: dict[str, Any]) -> dict[str, Any]:
    """A notification batch of ``items`` as Adyen sends it."""
    return {"live": "false", "notificationItems": [{"NotificationRequestItem": i} for i in items]}


__all__ = [
    "SIGNED_FIELDS",
    "AdyenVerifier",
    "adyen_batch",
    "adyen_verifier",
    "item_identity",
    "sign_adyen_item",
    "signing_string",
]
