"""Key and scope hygiene: what an idempotency key may look like before it reaches the store."""

from __future__ import annotations

import hashlib
import unicodedata

from consumer_idem.errors import InvalidKey

MAX_KEY_LENGTH = 255
HASHED_PREFIX = "sha256:"


def _has_control(text: str) -> bool:
    if text.isprintable():  # in C: printable text has no Cc, Cf or Cs character
        return False
    return any(unicodedata.category(ch) in ("Cc", "Cf", "Cs") for ch in text)


def normalize_key(raw: str | bytes, *, hash_invalid: bool = False) -> str:
    """Return the key to store, or raise [`InvalidKey`][consumer_idem.InvalidKey].

    A key must be non-empty valid UTF-8, at most 255 characters, without control characters.
    With ``hash_invalid=True`` an over-long key, or one with control characters or invalid UTF-8,
    is replaced by ``sha256:<hex>`` of its bytes instead (an empty key is always rejected: it
    carries no identity at all).
    """
    data = raw if isinstance(raw, bytes) else None
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as exc:
            if hash_invalid:
                return HASHED_PREFIX + hashlib.sha256(raw).hexdigest()
            raise InvalidKey("invalid_utf8", f"idempotency key is not valid UTF-8: {exc}") from exc
    else:
        text = raw
    if not text or not text.strip():
        raise InvalidKey("empty", "idempotency key is empty")
    problem: tuple[str, str] | None = None
    if len(text) > MAX_KEY_LENGTH:
        problem = (
            "too_long",
            f"idempotency key is {len(text)} characters; at most {MAX_KEY_LENGTH}",
        )
    elif _has_control(text):
        problem = ("control_characters", "idempotency key contains control characters")
    if problem is None:
        return text
    if hash_invalid:
        payload = data if data is not None else text.encode("utf-8", errors="surrogatepass")
        return HASHED_PREFIX + hashlib.sha256(payload).hexdigest()
    raise InvalidKey(*problem)


def validate_scope(scope: str) -> str:
    """A scope is required: a non-empty name without control characters, at most 255 chars."""
    if not isinstance(scope, str) or not scope.strip():
        raise InvalidKey("empty_scope", "scope is required (e.g. the consumer or route name)")
    if len(scope) > MAX_KEY_LENGTH or _has_control(scope):
        raise InvalidKey("invalid_scope", f"scope {scope[:40]!r}... is too long or has controls")
    return scope
