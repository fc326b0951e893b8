"""Webhook signature verification (pure functions)."""

from __future__ import annotations

import time

import pytest

from consumer_idem.webhooks import (
    WebhookVerificationError,
    sign_standard,
    sign_stripe,
    verify_standard,
    verify_stripe,
)

BODY = b'{"id":"evt_1","type":"charge.succeeded"}'
STANDARD = "whsec_" + "c2VjcmV0LW9uZS1mb3ItdGVzdHMtb25seS0xMjM0NTY="
OTHER = "whsec_" + "c2VjcmV0LXR3by1mb3ItdGVzdHMtb25seS0xMjM0NTY="


def test_stripe_valid_rotated_multiple_signatures() -> None:
    now = int(time.time())
    header = sign_stripe(BODY, "sk_new", now)
    assert verify_stripe(BODY, header, ["sk_old", "sk_new"]) == now
    old = sign_stripe(BODY, "sk_old", now).split(",")[1]
    assert verify_stripe(BODY, f"{header},{old}", ["sk_old"]) == now  # several v1= entries


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (None, 400),
        ("v1=abc", 400),
        ("t=x,v1=abc", 400),
        ("t=1,v1=abc", 401),
    ],
)
def test_stripe_malformed_and_stale(header: str | None, status: int) -> None:
    with pytest.raises(WebhookVerificationError) as info:
        verify_stripe(BODY, header, ["sk"])
    assert info.value.status == status


def test_stripe_forged_and_tampered() -> None:
    now = int(time.time())
    with pytest.raises(WebhookVerificationError) as info:
        verify_stripe(BODY, sign_stripe(BODY, "attacker", now), ["sk"])
    assert info.value.status == 401
    with pytest.raises(WebhookVerificationError):
        verify_stripe(BODY + b" ", sign_stripe(BODY, "sk", now), ["sk"])
    with pytest.raises(WebhookVerificationError):  # 301 s old: outside the 300 s tolerance
        verify_stripe(BODY, sign_stripe(BODY, "sk", now - 301), ["sk"])


def test_standard_webhooks() -> None:
    now = int(time.time())
    headers = sign_standard(BODY, STANDARD, "msg_1", now)
    assert verify_standard(BODY, headers, [OTHER, STANDARD]) == "msg_1"
    rotated = sign_standard(BODY, OTHER, "msg_1", now)["webhook-signature"]
    both = {**headers, "webhook-signature": f"{rotated} {headers['webhook-signature']}"}
    assert verify_standard(BODY, both, [STANDARD]) == "msg_1"
    for bad, status in (
        ({**headers, "webhook-id": "msg_2"}, 401),  # the id is signed too
        (sign_standard(BODY, STANDARD, "msg_1", now - 301), 401),
        (sign_standard(BODY, STANDARD, "msg_1", now + 301), 401),
        ({k: v for k, v in headers.items() if k != "webhook-signature"}, 400),
    ):
        with pytest.raises(WebhookVerificationError) as info:
            verify_standard(BODY, bad, [STANDARD])
        assert info.value.status == status


@pytest.mark.parametrize("forged", ["\xe9\xe9", "é" * 64, "\udcff", "٣" * 64])
def test_a_non_ascii_signature_is_a_401_not_a_crash(forged: str) -> None:
    """``hmac.compare_digest`` raises TypeError on non-ASCII str: compare bytes instead."""
    now = int(time.time())
    with pytest.raises(WebhookVerificationError) as info:
        verify_stripe(BODY, f"t={now},v1={forged}", ["sk"])
    assert info.value.status == 401
    headers = {**sign_standard(BODY, STANDARD, "msg_1", now), "webhook-signature": f"v1,{forged}"}
    with pytest.raises(WebhookVerificationError) as info:
        verify_standard(BODY, headers, [STANDARD])
    assert info.value.status == 401


def test_a_timestamp_is_ascii_digits() -> None:
    now = int(time.time())
    arabic = "".join(chr(0x0660 + int(d)) for d in str(now))  # int() would accept these
    with pytest.raises(WebhookVerificationError) as info:
        verify_stripe(BODY, f"t={arabic},v1=00", ["sk"])
    assert info.value.status == 400
