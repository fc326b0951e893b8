"""Incoming webhooks: verify the signature on the raw body, then process each event once.

* :func:`verify_stripe` — ``Stripe-Signature: t=<unix>,v1=<hex>[,v1=...]``: HMAC-SHA256 over
  ``"<t>.<raw body>"``, 300 s tolerance.
* :func:`verify_standard` — Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature: v1,<base64> [v1,<base64> ...]``, ``whsec_``-prefixed base64 secrets):
  HMAC-SHA256 over ``"<id>.<timestamp>.<raw body>"``, +-5 minutes.

Both compare in constant time and accept several secrets (rotation). A malformed header is a 400,
a wrong or stale signature a 401, and nothing is stored for either. A secret that cannot work (an
empty or non-base64 Standard Webhooks secret) is a :class:`WebhookSecretError` when the verifier
is built, not a failure of every delivery. :class:`WebhookReceiver` dedupes verified events by
(provider, event id) through the store: a duplicate gets a 2xx without being processed again,
and the handler's writes commit with the completion. An id longer than a key may be is stored
as its SHA-256 (``sha256:<hex>``). Keep webhook records longer than the provider retries (days):
pass ``retention``.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import starlette  # noqa: F401 - the http extra
except ImportError as exc:
    raise missing("http", exc, __name__) from exc

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
from starlette.requests import Request  # a real annotation: FastAPI injects by it
from starlette.responses import JSONResponse, Response

from consumer_idem.errors import (
    InvalidKey,
    NotUnknown,
    StoreUnavailable,
    WebhookSecretError,
    WebhookVerificationError,
)
from consumer_idem.execution import run_transactional
from consumer_idem.fingerprint import fingerprint_payload, parse_json
from consumer_idem.keys import normalize_key
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import OutcomeKind, Resolution

DEFAULT_TOLERANCE = 300
_DIGITS = re.compile(r"[0-9]{1,15}")


def _check_time(timestamp: str, tolerance: int, now: float | None) -> int:
    # ASCII digits only: int() also takes other scripts' digits, "_" and a sign
    if not _DIGITS.fullmatch(timestamp):
        raise WebhookVerificationError(400, "timestamp is not a number")
    ts = int(timestamp)
    if abs((time.time() if now is None else now) - ts) > tolerance:
        raise WebhookVerificationError(401, "timestamp outside the tolerance")
    return ts


def _matches(expected: str, offered: Sequence[str]) -> bool:
    """Constant-time comparison of the expected signature with each offered one, as bytes:
    ``hmac.compare_digest`` raises ``TypeError`` for a str that is not ASCII, and a forged
    header may carry anything (a 401, never a 500 the provider retries for days)."""
    want = expected.encode()
    return any(hmac.compare_digest(want, sig.encode("utf-8", "surrogatepass")) for sig in offered)


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
        if _matches(expected, signatures):
            return ts
    raise WebhookVerificationError(401, "no signature matches")


def _standard_key(secret: str) -> bytes:
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


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """``name`` (lower case) from ``headers``, matched case-insensitively as HTTP does, also in
    a plain dict (Starlette's ``Headers`` already is)."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


def verify_standard(
    payload: bytes,
    headers: Mapping[str, str],
    secrets: Sequence[str],
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> str:
    """Verify Standard Webhooks headers; returns the message id (``webhook-id``)."""
    msg_id = _header(headers, "webhook-id")
    timestamp = _header(headers, "webhook-timestamp")
    signatures = _header(headers, "webhook-signature")
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
        if _matches(expected, offered):
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
    """A Standard Webhooks verifier; raises :class:`WebhookSecretError` at once for a secret
    that cannot work (empty, not base64), instead of refusing every delivery later."""
    if isinstance(secrets, str) or not secrets:
        raise WebhookSecretError("pass a list of one or more whsec_ secrets")
    for secret in secrets:
        _standard_key(secret)
    return lambda body, headers: verify_standard(body, headers, secrets, tolerance=tolerance)


def stripe_verifier(secrets: Sequence[str], tolerance: int = DEFAULT_TOLERANCE) -> Verifier:
    if isinstance(secrets, str) or not secrets or not all(secrets):
        raise WebhookSecretError("pass a list of one or more non-empty Stripe signing secrets")

    def verify(body: bytes, headers: Mapping[str, str]) -> str:
        verify_stripe(body, headers.get("stripe-signature"), secrets, tolerance=tolerance)
        try:
            event_id = parse_json(body)["id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WebhookVerificationError(400, "the event has no id") from exc
        if not isinstance(event_id, str):  # a list or an object is no id ("['evt_1']")
            raise WebhookVerificationError(400, "the event id is not a string")
        return event_id

    return verify


class WebhookReceiver:
    """An endpoint: mount ``receiver.handle`` (a ``Request -> Response`` coroutine), in FastAPI
    ``app.add_api_route("/webhooks/stripe", receiver.handle, methods=["POST"])`` and in Starlette
    ``Route("/webhooks/stripe", receiver.handle, methods=["POST"])``. Not the receiver itself:
    FastAPI would read its ``request`` as a query parameter, Starlette would take it for an
    ASGI app.

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
            event = parse_json(body)  # ValueError also for JSON nested too deep to decode
            if not isinstance(event, dict):
                raise WebhookVerificationError(400, "the event must be a JSON object")
        except WebhookVerificationError as exc:
            return JSONResponse({"error": exc.reason}, status_code=exc.status)
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)

        async def handle(conn: asyncpg.Connection) -> Any:
            return await self.handler(event, conn)

        try:
            # an id past the key length limit (or with control characters) is kept as its hash
            key = normalize_key(event_id, hash_invalid=True)
        except InvalidKey:
            return JSONResponse({"error": "the event id is empty"}, status_code=400)
        try:
            outcome = await run_transactional(
                self.store,
                self.scope,
                key,
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

    handle = __call__  #: the endpoint as a method, for Starlette's ``Route``


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
