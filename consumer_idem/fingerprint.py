"""Fingerprints: what a unit of work *is*, so a reused key with another payload is caught.

JSON payloads are canonicalised with RFC 8785 (JSON Canonicalization Scheme, via the ``rfc8785``
package) and hashed with SHA-256; anything else is hashed as raw bytes. The value carries a
version prefix so the scheme can evolve without turning old keys into false misuse reports.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import rfc8785

VERSION = "v1"


def _digest(kind: str, data: bytes) -> str:
    return f"{VERSION}:{kind}:{hashlib.sha256(data).hexdigest()}"


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical bytes of a JSON value (raises ``ValueError`` for non-JSON values)."""
    try:
        return bytes(rfc8785.dumps(value))
    except (rfc8785.CanonicalizationError, TypeError) as exc:
        raise ValueError(f"value cannot be canonicalised as JSON: {exc}") from exc


def _pick(value: Any, path: str) -> Any:
    current = value
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        else:
            return None  # an absent field is fingerprinted as null, consistently
    return current


def fingerprint_json(value: Any, fields: Iterable[str] | None = None) -> str:
    """Fingerprint of a JSON value, or of the chosen dotted ``fields`` of it."""
    if fields is not None:
        value = {path: _pick(value, path) for path in fields}
    return _digest("jcs", canonical_json(value))


def fingerprint_bytes(data: bytes) -> str:
    """Fingerprint of raw bytes (non-JSON payloads)."""
    return _digest("raw", data)


def fingerprint_payload(body: bytes, fields: Iterable[str] | None = None) -> str:
    """JSON bodies are fingerprinted canonically (key order and spacing do not matter);
    anything that is not JSON, or JSON that RFC 8785 cannot canonicalise (an integer beyond
    +-2**53, say), falls back to its raw bytes."""
    try:
        return fingerprint_json(json.loads(body), fields)
    except (ValueError, UnicodeDecodeError):
        return fingerprint_bytes(body)
