"""Toss Payments. Two kinds of event arrive at one endpoint:

* **signed** (``payout.changed``, ``seller.changed``): ``tosspayments-webhook-signature:
  v1:<base64>,v1:<base64>`` (two while a key rotates) and
  ``tosspayments-webhook-transmission-time``;
  HMAC-SHA256 of ``"{raw body}:{transmission time}"`` with the security key, base64; the time
  is signed, so it must be within the tolerance. The identity is the event type, its
  ``createdAt`` and a digest of its ``data`` (a retry resends the same payload).
* **unsigned** payment-status events (``PAYMENT_STATUS_CHANGED`` and the like, with
  ``data.paymentKey``): nothing proves who sent them, so they follow the fetch-to-verify path:
  ``fetch_payment(paymentKey)`` re-reads the payment from Toss (your authenticated API call),
  and the handler gets the event with ``data`` replaced by what Toss answered. The identity is
  the payment key and the status Toss reports: a payment's each status change runs once.
  Without ``fetch_payment`` such an event is refused (401).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from consumer_idem.errors import WebhookVerificationError
from consumer_idem.fingerprint import canonical_json, fingerprint_json, fingerprint_payload
from consumer_idem.webhooks._verify import (
    DEFAULT_TOLERANCE,
    HmacVerifier,
    Scheme,
    header_values,
    hmac_sha256,
    json_object,
    string_field,
)
from consumer_idem.webhooks.receiver import Delivery

PaymentFetcher = Callable[[str], Awaitable[dict[str, Any]]]
SIGNATURE_HEADER = "tosspayments-webhook-signature"
TIME_HEADER = "tosspayments-webhook-transmission-time"


def _split(value: str) -> tuple[str | None, list[str]]:
    entries = (entry.strip().partition(":") for entry in value.split(","))
    return None, [sig for version, _, sig in entries if version == "v1"]


def _signed(body: bytes, timestamp: str | None, headers: Mapping[str, str]) -> bytes:
    return body + f":{timestamp}".encode()


def _signed_identity(event: dict[str, Any], headers: Mapping[str, str]) -> str:
    kind = string_field(event, "eventType", "Toss event")
    created = string_field(event, "createdAt", "Toss event")
    return f"{kind}:{created}:{_digest(event.get('data'))}"


def _digest(data: Any) -> str:
    """A digest of ``data`` the same for every retry: its RFC 8785 form, or, for JSON that has
    none (an integer beyond 2**53, nesting too deep), its sorted ``json.dumps``."""
    try:
        encoded = canonical_json(data)
    except ValueError:
        encoded = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


TOSS = Scheme(
    sender="toss",
    header=SIGNATURE_HEADER,
    split=_split,
    template=_signed,
    encoding="base64",
    timestamp="iso",
    timestamp_header=TIME_HEADER,
    identity=_signed_identity,
)


class TossVerifier:
    """Signed Toss events by HMAC (several security keys: rotation); unsigned payment events
    by re-reading the payment with ``fetch_payment``."""

    sender = "toss"

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        fetch_payment: PaymentFetcher | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        self.signed = HmacVerifier(TOSS, secrets, tolerance=tolerance)
        self.fetch_payment = fetch_payment

    async def deliveries(self, body: bytes, headers: Mapping[str, str]) -> list[Delivery]:
        if header_values(headers, SIGNATURE_HEADER):  # signed: never the unsigned path
            event_id, event = self.signed.event(body, headers)
            return [Delivery(event_id, event, fingerprint_payload(body))]
        return [await self._fetched(json_object(body))]

    async def _fetched(self, event: dict[str, Any]) -> Delivery:
        data = event.get("data")
        payment_key = data.get("paymentKey") if isinstance(data, dict) else None
        if not isinstance(payment_key, str) or not payment_key:
            raise WebhookVerificationError(400, f"the {SIGNATURE_HEADER} header is missing")
        if self.fetch_payment is None:
            raise WebhookVerificationError(
                401, "an unsigned Toss payment event needs fetch_payment to be verified"
            )
        try:
            payment = await self.fetch_payment(payment_key)
        except Exception as exc:  # the gateway is I/O: an outage to wait out
            raise WebhookVerificationError(503, "the payment cannot be re-read from Toss") from exc
        if not isinstance(payment, dict) or payment.get("paymentKey") != payment_key:
            raise WebhookVerificationError(401, "Toss does not know this payment")
        status = payment.get("status")
        event_id = f"payment:{payment_key}:{status}"
        verified = {**event, "data": payment}
        return Delivery(event_id, verified, fingerprint_json({"event": event_id}))


def toss_verifier(
    secrets: Sequence[str],
    *,
    fetch_payment: PaymentFetcher | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> TossVerifier:
    """A Toss verifier: security keys for signed events (rotation), ``fetch_payment`` for the
    unsigned payment events."""
    return TossVerifier(secrets, fetch_payment=fetch_payment, tolerance=tolerance)


def sign_toss(payload: bytes, secret: str, transmission_time: str) -> dict[str, str]:
    """The headers Toss sends with a signed event (for tests and local tools)."""
    signed = payload + f":{transmission_time}".encode()
    return {
        SIGNATURE_HEADER: "v1:" + hmac_sha256(secret.encode(), signed, "base64"),
        TIME_HEADER: transmission_time,
    }
