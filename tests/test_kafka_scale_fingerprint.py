"""The fingerprint fast path (the standard library's C encoder for plain JSON) writes exactly the
bytes of the ``rfc8785`` package: a stored fingerprint must never change with the code path,
or a redelivered message would be reported as key misuse."""

from __future__ import annotations

import json
from typing import Any

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_idem.fingerprint import MAX_DEPTH, _plain, canonical_json, fingerprint_payload
from consumer_idem.keys import normalize_key

# every code point, lone surrogates and characters beyond U+FFFF included
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.integers(min_value=-(2**53) - 2, max_value=2**53 + 2)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=25,
)


def reference(value: Any) -> bytes | type[BaseException]:
    try:
        return bytes(rfc8785.dumps(value))
    except (rfc8785.CanonicalizationError, UnicodeError, TypeError):
        return ValueError


def ours(value: Any) -> bytes | type[BaseException]:
    try:
        return canonical_json(value)
    except ValueError:
        return ValueError


@settings(max_examples=600, deadline=None)
@given(JSON)
def test_the_fast_path_writes_the_rfc8785_bytes_or_refuses_the_same_values(value: Any) -> None:
    assert ours(value) == reference(value)


def test_typical_payloads_take_the_fast_path_and_match() -> None:
    payloads: list[Any] = [
        {"payment_id": "p-1", "customer_id": "c", "amount_cents": 1999, "currency": "EUR"},
        {"b": [1, {"z": None, "a": True}], "a": '\u00e9\u20ac\x00\x1f\x7f"\\\n\t\b\f\r'},
        {"\ue000": 1, "\uffff": 2, "a": 3, "": [[]]},
        ["x", -(2**53) + 1, 2**53 - 1, False],
        "just a string",
        None,
    ]
    for payload in payloads:
        assert _plain(payload), payload
        assert canonical_json(payload) == bytes(rfc8785.dumps(payload))


def test_what_the_fast_path_refuses_goes_the_slow_way() -> None:
    # beyond the BMP a key sorts differently in UTF-16 (JCS) and in code points (Python)
    astral = {"\U0001f600": 1, "\ue000": 2}
    assert not _plain(astral)
    assert canonical_json(astral) == bytes(rfc8785.dumps(astral))
    assert json.dumps(astral, sort_keys=True, ensure_ascii=False).encode() != canonical_json(astral)
    for value in (1.0, {"a": 1.5}, (1, 2), 2**53, {1: "int key"}):
        assert not _plain(value)
    deep: Any = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    assert not _plain(deep)
    # too deep is fingerprinted as raw bytes, as before
    body = json.dumps(deep).encode()
    assert fingerprint_payload(body).startswith("v1:raw:")


@settings(max_examples=400, deadline=None)
@given(TEXT)
def test_the_key_hygiene_fast_path_accepts_and_refuses_what_the_full_check_does(text: str) -> None:
    import unicodedata

    controls = any(unicodedata.category(ch) in ("Cc", "Cf", "Cs") for ch in text)
    try:
        normalize_key(text)
        accepted = True
    except Exception:
        accepted = False
    expected = bool(text.strip()) and len(text) <= 255 and not controls
    assert accepted == expected
