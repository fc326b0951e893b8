"""The one verification mechanism every HMAC scheme shares.

A scheme is data ([`Scheme`][consumer_idem.webhooks._verify.Scheme]): the header that carries the
signature and how to split it,
the signed-string template, how a secret becomes a key, how a digest is written (hex or base64),
whether a timestamp is signed, and where the event's identity lives.
[`HmacVerifier`][consumer_idem.webhooks._verify.HmacVerifier] does
the rest the same way for all of them:

* the raw body, before any parsing;
* each secret decoded when the verifier is built (an empty or malformed secret is a
  [`WebhookSecretError`][consumer_idem.WebhookSecretError] then, not a refusal of every delivery
  later); several secrets
  are key rotation: a signature made with any of them is accepted;
* a header missing or sent twice is a 400; a signature that is not ASCII, not the scheme's
  encoding or not a digest's length never matches (a 401, never a 500);
* digests compared as bytes with `hmac.compare_digest`, after a length guard;
* a timestamp tolerance (stale or future) only where the scheme signs a timestamp.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from consumer_idem.errors import WebhookSecretError, WebhookVerificationError
from consumer_idem.fingerprint import parse_json

DEFAULT_TOLERANCE = 300
SHA256_SIZE = hashlib.sha256().digest_size
_DIGITS = re.compile(r"[0-9]{1,15}")
Encoding = Literal["hex", "base64"]
#: header value -> (timestamp or None, the signatures offered)
SplitHeader = Callable[[str], tuple[str | None, list[str]]]


def header_values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header ``name`` (lower case), matched case-insensitively as HTTP does;
    Starlette's ``Headers`` keeps repeated headers (``getlist``), a plain dict cannot."""
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return list(getlist(name))
    return [v for k, v in headers.items() if k.lower() == name]


def one_header(headers: Mapping[str, str], name: str) -> str:
    """The single value of a required header: missing, empty or sent twice is a 400."""
    values = header_values(headers, name)
    if len(values) > 1:
        raise WebhookVerificationError(400, f"the {name} header is sent more than once")
    if not values or not values[0].strip():
        raise WebhookVerificationError(400, f"the {name} header is missing")
    return values[0].strip()


def check_unix_time(timestamp: str, tolerance: float, now: float | None) -> int:
    """A signed Unix timestamp within ``tolerance`` seconds of now (either side)."""
    # ASCII digits only: int() also takes other scripts' digits, "_" and a sign
    if not _DIGITS.fullmatch(timestamp):
        raise WebhookVerificationError(400, "the timestamp is not a number")
    ts = int(timestamp)
    _within(ts, tolerance, now)
    return ts


def check_iso_time(timestamp: str, tolerance: float, now: float | None) -> None:
    """A signed ISO 8601 time with its offset, within ``tolerance`` seconds of now."""
    try:
        when = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError as exc:
        raise WebhookVerificationError(400, "the transmission time is not ISO 8601") from exc
    if when.tzinfo is None:  # a time without its offset could be any of 26 hours
        raise WebhookVerificationError(400, "the transmission time has no UTC offset")
    _within(when.timestamp(), tolerance, now)


def checked_tolerance(tolerance: float) -> float:
    """A signed time's tolerance: positive and finite. NaN compares false with everything, so
    a NaN (or infinite) tolerance would accept any time: a seen request replayable for ever."""
    if not 0 < tolerance < math.inf:
        raise WebhookSecretError(f"the timestamp tolerance must be positive, not {tolerance}")
    return tolerance


def _within(ts: float, tolerance: float, now: float | None) -> None:
    if abs((time.time() if now is None else now) - ts) > tolerance:
        raise WebhookVerificationError(401, "the timestamp is outside the tolerance")


def decode_digest(text: str, encoding: Encoding) -> bytes | None:
    """An offered signature as digest bytes, or None when it cannot be one (not ASCII, not the
    encoding, not a SHA-256 digest's length): such a signature matches nothing."""
    try:
        raw = text.strip().encode("ascii")
        decoded = (
            binascii.unhexlify(raw) if encoding == "hex" else base64.b64decode(raw, validate=True)
        )
    except (UnicodeEncodeError, binascii.Error, ValueError):
        return None
    return decoded if len(decoded) == SHA256_SIZE else None


def matches(signed: bytes, keys: Sequence[bytes], offered: Sequence[bytes]) -> bool:
    """Does any offered digest equal the HMAC-SHA256 of ``signed`` under any key? Constant
    time per comparison, on bytes (``compare_digest`` raises TypeError on a non-ASCII str)."""
    found = False
    for key in keys:
        want = hmac.new(key, signed, hashlib.sha256).digest()
        for candidate in offered:
            found = hmac.compare_digest(want, candidate) or found
    return found


def hmac_sha256(key: bytes, signed: bytes, encoding: Encoding) -> str:
    """A digest written the scheme's way (for the senders' side: signing helpers and tests)."""
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return digest.hex() if encoding == "hex" else base64.b64encode(digest).decode()


def text_key(secret: str) -> bytes:
    """Most senders use the secret's text as the HMAC key."""
    return secret.encode()


def hex_key(secret: str) -> bytes:
    """Adyen's HMAC key is hex: its bytes, not its text, are the key."""
    try:
        return bytes.fromhex(secret)
    except ValueError as exc:
        raise WebhookSecretError("this HMAC key is hexadecimal (0-9, A-F)") from exc


def secret_keys(secrets: Sequence[str], decode: Callable[[str], bytes], sender: str) -> list[bytes]:
    """Every secret decoded now, so a secret that cannot work refuses to start."""
    if isinstance(secrets, str) or not secrets:
        raise WebhookSecretError(f"pass a list of one or more {sender} secrets (rotation: several)")
    keys = []
    for secret in secrets:
        if not isinstance(secret, str) or not secret.strip():
            raise WebhookSecretError(f"a {sender} secret is empty: anyone could sign")
        key = decode(secret.strip())
        if not key:
            raise WebhookSecretError(f"a {sender} secret is empty: anyone could sign")
        keys.append(key)
    return keys


def json_object(body: bytes) -> dict[str, Any]:
    """The signed body as a JSON object, or a 400 naming what it is instead."""
    try:
        event = parse_json(body)  # ValueError also for JSON nested too deep to decode
    except ValueError as exc:
        raise WebhookVerificationError(400, "the body is not JSON") from exc
    if not isinstance(event, dict):
        raise WebhookVerificationError(400, "the body is not a JSON object")
    return event


def string_field(event: Mapping[str, Any], name: str, what: str) -> str:
    """A required string field of the event (its identity), or a 400 naming it."""
    value = event.get(name)
    if value is None:
        raise WebhookVerificationError(400, f"the {what} has no {name!r} field")
    if not isinstance(value, str) or not value:  # a list or an object is no id ("['evt_1']")
        raise WebhookVerificationError(400, f"the {what}'s {name!r} is not a non-empty string")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Scheme:
    """One sender's HMAC-SHA256 scheme, as data."""

    sender: str
    header: str  #: lower case
    split: SplitHeader
    #: (raw body, signed timestamp or None, headers) -> the bytes the sender signs
    template: Callable[[bytes, str | None, Mapping[str, str]], bytes]
    encoding: Encoding
    key: Callable[[str], bytes] = text_key
    timestamp: Literal["unix", "iso"] | None = None
    #: the header the signed timestamp comes in, when not the signature's own
    timestamp_header: str | None = None
    #: (event, headers) -> the event's identity, deduplicated per sender
    identity: Callable[[dict[str, Any], Mapping[str, str]], str]


class HmacVerifier:
    """A verifier for one [`Scheme`][consumer_idem.webhooks._verify.Scheme] and its secrets. Calling
    it with ``(body, headers)``
    returns the event id, or raises
    [`WebhookVerificationError`][consumer_idem.WebhookVerificationError] (400 malformed, 401 not
    signed by any secret); `event` returns the id and the parsed event."""

    def __init__(
        self, scheme: Scheme, secrets: Sequence[str], *, tolerance: float = DEFAULT_TOLERANCE
    ) -> None:
        self.scheme = scheme
        self.sender = scheme.sender
        self._keys = secret_keys(secrets, scheme.key, scheme.sender)
        self.tolerance = checked_tolerance(tolerance) if scheme.timestamp else tolerance

    def check(self, body: bytes, headers: Mapping[str, str], now: float | None = None) -> None:
        """The signature alone."""
        scheme = self.scheme
        timestamp, offered = scheme.split(one_header(headers, scheme.header))
        if scheme.timestamp_header is not None:
            timestamp = one_header(headers, scheme.timestamp_header)
        if not offered:
            raise WebhookVerificationError(400, f"the {scheme.header} header has no signature")
        if scheme.timestamp is not None:
            if timestamp is None:
                raise WebhookVerificationError(400, f"the {scheme.header} header has no time")
            check = check_unix_time if scheme.timestamp == "unix" else check_iso_time
            check(timestamp, self.tolerance, now)
        digests = [d for d in (decode_digest(s, scheme.encoding) for s in offered) if d]
        if not matches(scheme.template(body, timestamp, headers), self._keys, digests):
            raise WebhookVerificationError(401, "no signature matches")

    def event(
        self, body: bytes, headers: Mapping[str, str], now: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Verify, then parse: (event id, event)."""
        self.check(body, headers, now)
        event = json_object(body)
        return self.scheme.identity(event, headers), event

    def __call__(self, body: bytes, headers: Mapping[str, str]) -> str:
        return self.event(body, headers)[0]


def header_identity(name: str) -> Callable[[dict[str, Any], Mapping[str, str]], str]:
    """The identity a header carries (``X-GitHub-Delivery``, ``webhook-id``, ...)."""
    return lambda event, headers: one_header(headers, name)


def field_identity(name: str, what: str) -> Callable[[dict[str, Any], Mapping[str, str]], str]:
    """The identity a top-level field of the body carries (Stripe's ``id``, ...)."""
    return lambda event, headers: string_field(event, name, what)


def raw_body(body: bytes, timestamp: str | None, headers: Mapping[str, str]) -> bytes:
    """The signed string of the senders that sign the raw body alone (no timestamp)."""
    return body


def bare_signature(value: str) -> tuple[str | None, list[str]]:
    """A header that is the signature alone (Razorpay, Checkout.com, Shopify)."""
    return None, [value]
