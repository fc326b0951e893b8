"""Key hygiene and fingerprints (pure functions)."""

from __future__ import annotations

import pytest

from consumer_idem import (
    InvalidKey,
    canonical_json,
    fingerprint_bytes,
    fingerprint_json,
    fingerprint_payload,
)
from consumer_idem.keys import normalize_key, validate_scope


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        (b"", "empty"),
        ("x" * 256, "too_long"),
        ("abc\x00def", "control_characters"),
        ("line\nbreak", "control_characters"),
        ("zero\u200bwidth", "control_characters"),
        (b"\xff\xfe", "invalid_utf8"),
    ],
)
def test_invalid_keys_are_rejected_with_a_reason(raw: str | bytes, reason: str) -> None:
    with pytest.raises(InvalidKey) as info:
        normalize_key(raw)
    assert info.value.reason == reason


def test_valid_keys_pass_unchanged() -> None:
    assert normalize_key("order-1:attempt/2") == "order-1:attempt/2"
    assert normalize_key("x" * 255) == "x" * 255
    assert normalize_key("zahlung-ü".encode()) == "zahlung-ü"


@pytest.mark.parametrize("raw", ["x" * 10_000, "a\x01b", b"\xff\xfe"])
def test_opt_in_hashing_of_bad_keys(raw: str | bytes) -> None:
    hashed = normalize_key(raw, hash_invalid=True)
    assert hashed.startswith("sha256:") and len(hashed) == 7 + 64
    assert normalize_key(raw, hash_invalid=True) == hashed


def test_empty_key_is_rejected_even_when_hashing() -> None:
    with pytest.raises(InvalidKey):
        normalize_key("", hash_invalid=True)


def test_scope_is_required() -> None:
    with pytest.raises(InvalidKey):
        validate_scope("")
    assert validate_scope("payments-consumer") == "payments-consumer"


def test_canonical_json_follows_rfc8785() -> None:
    assert canonical_json({"b": 1, "a": [True, None, "x"]}) == b'{"a":[true,null,"x"],"b":1}'
    assert canonical_json(1.0) == b"1"
    assert canonical_json(1e21) == b"1e+21"
    with pytest.raises(ValueError):
        canonical_json(float("nan"))


def test_fingerprint_ignores_key_order_and_spacing() -> None:
    a = fingerprint_payload(b'{"amount": 100, "currency": "EUR"}')
    b = fingerprint_payload(b'{"currency":"EUR","amount":100}')
    assert a == b
    assert a.startswith("v1:jcs:")
    assert a != fingerprint_payload(b'{"currency":"EUR","amount":101}')


def test_fingerprint_of_chosen_fields() -> None:
    one = {"amount": 100, "meta": {"trace": "t1"}, "customer": {"id": "c1"}}
    two = {"amount": 100, "meta": {"trace": "t2"}, "customer": {"id": "c1"}}
    fields = ["amount", "customer.id"]
    assert fingerprint_json(one, fields) == fingerprint_json(two, fields)
    assert fingerprint_json(one) != fingerprint_json(two)


def test_non_json_payloads_hash_raw_bytes() -> None:
    assert fingerprint_payload(b"\x00\x01binary") == fingerprint_bytes(b"\x00\x01binary")
    assert fingerprint_bytes(b"a").startswith("v1:raw:")
    assert fingerprint_bytes(b"a") != fingerprint_bytes(b"b")


def test_json_rfc8785_cannot_canonicalise_falls_back_to_raw_bytes() -> None:
    body = b'{"customer_id": -602461404814797184}'  # beyond +-2**53: no canonical form
    assert fingerprint_payload(body) == fingerprint_bytes(body)


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,  # json.loads: RecursionError
        b"[" * 100_000,  # and not even JSON
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"[" * 900 + b"]" * 900,  # json.loads copes; RFC 8785 (pure Python) would not
    ],
)
def test_deeply_nested_json_falls_back_to_raw_bytes(body: bytes) -> None:
    """Never a RecursionError (an HTTP 500, a crashed consumer): nesting past ``MAX_DEPTH``
    is fingerprinted as its raw bytes, whatever the stack depth of the caller."""
    assert fingerprint_payload(body) == fingerprint_bytes(body)


def test_nesting_depth_is_a_fixed_rule_not_the_stack() -> None:
    from consumer_idem.fingerprint import MAX_DEPTH

    assert fingerprint_json(_nested(MAX_DEPTH - 1)).startswith("v1:jcs:")
    for too_deep in (_nested(MAX_DEPTH + 1), _nested(5_000)):
        with pytest.raises(ValueError, match="nested"):
            canonical_json(too_deep)
        with pytest.raises(ValueError):
            fingerprint_json(too_deep)
