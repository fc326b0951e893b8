"""Fingerprints: what a unit of work *is*, so a reused key with another payload is caught.

JSON payloads are canonicalised with RFC 8785 (JSON Canonicalization Scheme, via the ``rfc8785``
package) and hashed with SHA-256; anything else is hashed as raw bytes. The value carries a
version prefix so the scheme can evolve without turning old keys into false misuse reports.

JSON nested deeper than `MAX_DEPTH` has no canonical form here: it is hashed as its raw
bytes. The limit is a fixed rule, not the interpreter's recursion limit, so the same payload
gets the same fingerprint however deep the caller's stack is (a hostile ``[[[[...`` body is a
fingerprint, never a ``RecursionError``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import rfc8785

VERSION = "v1"
#: JSON nested deeper than this (arrays and objects) is fingerprinted as raw bytes
MAX_DEPTH = 128


def _digest(kind: str, data: bytes) -> str:
    return f"{VERSION}:{kind}:{hashlib.sha256(data).hexdigest()}"


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Does ``value`` nest lists/dicts more than ``limit`` levels deep? (No recursion.)"""
    stack = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        children = current.values() if isinstance(current, Mapping) else current
        if depth > limit:
            return True
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, Mapping | list | tuple)
        )
    return False


#: the integers RFC 8785 accepts (exactly representable as an IEEE 754 double)
_SAFE_INT = 2**53 - 1
#: the standard library's encoder with JCS's separators and no escaping beyond JSON's own: for
#: the values :func:`_plain` admits its output is RFC 8785's, byte for byte. No cycle check is
#: needed: :func:`_plain` admits no value nested deeper than :data:`MAX_DEPTH`, so none with a
#: cycle.
_PLAIN_ENCODER = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False, check_circular=False
)
_encode_plain = _PLAIN_ENCODER.encode


def _plain(value: Any) -> bool:
    """Is ``value`` made only of dicts (string keys without characters beyond U+FFFF), lists,
    strings, integers within +-(2**53 - 1), booleans and None, at most `MAX_DEPTH` deep?

    For such a value the standard library's encoder (sorted keys, no spaces, no ASCII escaping)
    writes exactly the RFC 8785 bytes: strings are escaped the same way (quote, backslash, the
    short forms, other control characters as lower-case ``u00xx``), integers print the same,
    and for keys within the BMP code point order is UTF-16 code unit order. Floats (ECMAScript
    number formatting), tuples, other mappings and subclasses go to the ``rfc8785`` package."""
    kind = type(value)
    if kind is not dict and kind is not list:
        return _plain_scalar(value)
    stack = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        children = _plain_values(current) if type(current) is dict else current
        if children is None:
            return False
        for child in children:
            t = type(child)
            if t is dict or t is list:
                stack.append((child, depth + 1))
            elif not (t is str or t is bool or child is None or _plain_scalar(child)):
                return False
    return True


def _plain_values(mapping: dict[Any, Any]) -> Iterable[Any] | None:
    """The values of ``mapping``, or None when a key is not a string within the BMP."""
    for k in mapping:
        if type(k) is not str or (not k.isascii() and max(k) > "\uffff"):
            return None
    return mapping.values()


def _plain_scalar(value: Any) -> bool:
    t = type(value)
    if t is str or t is bool or value is None:
        return True
    return t is int and -_SAFE_INT <= value <= _SAFE_INT


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical bytes of a JSON value (raises ``ValueError`` for non-JSON values and
    for values nested deeper than `MAX_DEPTH`)."""
    if _plain(value):
        # the common case, in C (the pure-Python serialiser was a third of a batch's CPU)
        try:
            return _encode_plain(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: rfc8785 reports it
            pass
    if isinstance(value, Mapping | list | tuple) and _nested_deeper_than(value, MAX_DEPTH):
        raise ValueError(f"value is nested deeper than {MAX_DEPTH} levels")
    try:
        return bytes(rfc8785.dumps(value))
    except (rfc8785.CanonicalizationError, TypeError, RecursionError) as exc:
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


def parse_json(body: bytes) -> Any:
    """``json.loads``, with every way it can refuse a body as ``ValueError``: not JSON, not
    UTF-8, or nested so deep that the decoder runs out of stack (``RecursionError``)."""
    try:
        return json.loads(body)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply to decode") from exc


def fingerprint_payload(body: bytes, fields: Iterable[str] | None = None) -> str:
    """JSON bodies are fingerprinted canonically (key order and spacing do not matter);
    anything that is not JSON, or JSON that RFC 8785 cannot canonicalise (an integer beyond
    +-2**53, nesting deeper than `MAX_DEPTH`), falls back to its raw bytes."""
    try:
        return fingerprint_json(parse_json(body), fields)
    except ValueError:  # UnicodeDecodeError is a ValueError
        return fingerprint_bytes(body)
