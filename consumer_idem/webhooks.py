"""Incoming webhooks: verify the signature on the raw body, then process each event once.

* :func:`verify_stripe` — ``Stripe-Signature: t=<unix>,v1=<hex>[,v1=...]``: HMAC-SHA256 over
  ``"<t>.<raw body>"``, 300 s tolerance.
* :func:`verify_standard` — Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature: v1,<base64> [v1,<base64> ...]``, ``whsec_``-prefixed base64 secrets):
  HMAC-SHA256 over ``"<id>.<timestamp>.<raw body>"``, +-5 minutes.

Both compare in constant time and accept several secrets (rotation). A malformed header is a 400,
a wrong or stale signature a 401, and nothing is stored for either. :class:`WebhookReceiver`
dedupes verified events by (provider, event id) through the store: a duplicate gets a 2xx
without being processed again, and the handler's writes commit with the completion. Keep
webhook records longer than the provider retries (days): pass ``retention``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
from starlette.requests import Request  # a real annotation: FastAPI injects by it
from starlette.responses import JSONResponse, Response

from consumer_idem.errors import NotUnknown, StoreUnavailable
from consumer_idem.execution import run_transactional
from consumer_idem.fingerprint import fingerprint_payload
from consumer_idem.store import PostgresStore, Resolution
from consumer_idem.types import OutcomeKind

DEFAULT_TOLERANCE = 300


class WebhookVerificationError(Exception):
    """``status`` is 400 (malformed) or 401 (wrong or stale signature)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _check_time(timestamp: str, tolerance: int, now: float | None) -> int:
    try:
        ts = int(timestamp)
    except ValueError as exc:
        raise WebhookVerificationError(400, "timestamp is not a number") from exc
    if abs((time.time() if now is None else now) - ts) > tolerance:
        raise WebhookVerificationError(401, "timestamp outside the tolerance")
    return ts


def verify_stripe(
    payload: bytes,
    header: str | None,
    secrets: Sequence[str],
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> int:
    """Verify a ``Stripe-Signature`` header; returns its timestamp."""
    if not header:
        raise WebhookVerificationError(400, "Stripe-Signature header missing")
    pairs = [part.split("=", 1) for part in header.split(",") if "=" in part]
    timestamps = [v for k, v in pairs if k.strip() == "t"]
    signatures = [v.strip() for k, v in pairs if k.strip() == "v1"]
    if len(timestamps) != 1 or not signatures:
        raise WebhookVerificationError(400, "Stripe-Signature needs one t= and a v1=")
    ts = _check_time(timestamps[0].strip(), tolerance, now)
    signed = f"{ts}.".encode() + payload
    for secret in secrets:
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, sig) for sig in signatures):
            return ts
    raise WebhookVerificationError(401, "no signature matches")


def _standard_key(secret: str) -> bytes:
    try:
        return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error as exc:
        raise ValueError("a Standard Webhooks secret is whsec_ + base64") from exc


def verify_standard(
    payload: bytes,
    headers: Mapping[str, str],
    secrets: Sequence[str],
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> str:
    """Verify Standard Webhooks headers; returns the message id (``webhook-id``)."""
    msg_id = headers.get("webhook-id")
    timestamp = headers.get("webhook-timestamp")
    signatures = headers.get("webhook-signature")
    if not msg_id or not timestamp or not signatures:
        raise WebhookVerificationError(
            400, "webhook-id, webhook-timestamp and webhook-signature are required"
        )
    _check_time(timestamp, tolerance, now)
    signed = f"{msg_id}.{timestamp}.".encode() + payload
    offered = [
        sig
        for version, _, sig in (entry.partition(",") for entry in signatures.split())
        if version == "v1"
    ]
    for secret in secrets:
        digest = hmac.new(_standard_key(secret), signed, hashlib.sha256).digest()
        expected = base64.b64encode(digest).decode()
        if any(hmac.compare_digest(expected, sig) for sig in offered):
            return msg_id
    raise WebhookVerificationError(401, "no signature matches")


def sign_standard(payload: bytes, secret: str, msg_id: str, timestamp: int) -> dict[str, str]:
    """Headers for a Standard Webhooks message (for senders, and for tests)."""
    signed = f"{msg_id}.{timestamp}.".encode() + payload
    sig = base64.b64encode(hmac.new(_standard_key(secret), signed, hashlib.sha256).digest())
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": f"v1,{sig.decode()}",
    }


def sign_stripe(payload: bytes, secret: str, timestamp: int) -> str:
    """A ``Stripe-Signature`` header value (for tests and local tools)."""
    sig = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    return f"t={timestamp},v1={sig.hexdigest()}"


EventHandler = Callable[[dict[str, Any], asyncpg.Connection], Awaitable[Any]]
Verifier = Callable[[bytes, Mapping[str, str]], str]  # returns the event id


def standard_verifier(secrets: Sequence[str], tolerance: int = DEFAULT_TOLERANCE) -> Verifier:
    return lambda body, headers: verify_standard(body, headers, secrets, tolerance=tolerance)


def stripe_verifier(secrets: Sequence[str], tolerance: int = DEFAULT_TOLERANCE) -> Verifier:
    def verify(body: bytes, headers: Mapping[str, str]) -> str:
        verify_stripe(body, headers.get("stripe-signature"), secrets, tolerance=tolerance)
        try:
            event_id = json.loads(body)["id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WebhookVerificationError(400, "the event has no id") from exc
        return str(event_id)

    return verify


class WebhookReceiver:
    """A Starlette/FastAPI endpoint: ``Route("/webhooks/stripe", receiver, methods=["POST"])``.

    ``handler(event, conn)`` runs once per (provider, event id), inside the transaction that
    records the event as processed.
    """

    def __init__(
        self,
        store: PostgresStore | Callable[[], PostgresStore],
        provider: str,
        verify: Verifier,
        handler: EventHandler,
        *,
        retention: timedelta = timedelta(days=30),
    ) -> None:
        self._store = store
        self.scope = f"webhook:{provider}"
        self.verify = verify
        self.handler = handler
        self.retention = retention

    @property
    def store(self) -> PostgresStore:
        """The store, or a factory of it (an app that creates its pool at start-up)."""
        return self._store if isinstance(self._store, PostgresStore) else self._store()

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        try:
            event_id = self.verify(body, request.headers)
            event = json.loads(body)
            if not isinstance(event, dict):
                raise WebhookVerificationError(400, "the event must be a JSON object")
        except WebhookVerificationError as exc:
            return JSONResponse({"error": exc.reason}, status_code=exc.status)
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)

        async def handle(conn: asyncpg.Connection) -> Any:
            return await self.handler(event, conn)

        try:
            outcome = await run_transactional(
                self.store,
                self.scope,
                event_id,
                fingerprint_payload(body),
                handle,
                retention=self.retention,
            )
        except StoreUnavailable:
            return JSONResponse({"error": "try again later"}, status_code=503)
        if outcome.kind in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED):
            return JSONResponse(
                {"received": True, "duplicate": outcome.kind is OutcomeKind.REPLAYED}
            )
        if outcome.kind is OutcomeKind.MISUSE:
            return JSONResponse({"error": "event id reused with another payload"}, status_code=422)
        if outcome.kind is OutcomeKind.UNKNOWN:
            return JSONResponse({"received": True, "outcome": "unknown"}, status_code=202)
        # failed (the handler raised) or in progress: ask the provider to deliver it again
        return JSONResponse({"error": "not processed, retry"}, status_code=500)


async def resolve_unknown(
    store: PostgresStore,
    scope: str,
    key: str,
    resolution: Resolution,
    *,
    conn: asyncpg.Connection | None = None,
) -> bool:
    """Let an authoritative event (a payment gateway's webhook) settle an ``unknown`` record.
    Returns False if the record is not unknown (already settled: nothing to do)."""
    try:
        await store.resolve(scope, key, resolution, conn=conn)
    except NotUnknown:
        return False
    return True
