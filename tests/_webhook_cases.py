"""Each sender's deliveries, signed the way its documentation describes, for the tests.

A :class:`Case` builds a request for an event id with a secret at a time, and a request whose
signature is right but written in the wrong encoding (hex for base64, a key not decoded).
PayPal signs with a key pair: :func:`paypal_identity` makes a self-signed certificate here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from consumer_idem import webhooks as wh

Headers = list[tuple[str, str]]
Request = tuple[bytes, Headers]


def event_body(event_id: str, **fields: Any) -> bytes:
    return json.dumps({"id": event_id, "amount": 4200, **fields}).encode()


def iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def swap_encoding(signature: str) -> str:
    """The same digest in the other encoding (hex <-> base64)."""
    try:
        return base64.b64encode(bytes.fromhex(signature)).decode()
    except ValueError:
        return base64.b64decode(signature).hex()


@dataclass(frozen=True)
class Case:
    name: str
    verifier: Callable[[list[str]], Any]
    secrets: tuple[str, str]  #: (the current secret, the one rotated in)
    make: Callable[[str, str, int], Request]  #: (event id, secret, unix time) -> request
    wrong_encoding: Callable[[str, str, int], Request]
    header: str | None  #: the signature header (None: signed inside the body)
    signed_time: bool
    event_id_of: Callable[[str], str] = field(default=lambda event_id: event_id)


def _stripe(event_id: str, secret: str, ts: int) -> Request:
    body = event_body(event_id)
    return body, [("Stripe-Signature", wh.sign_stripe(body, secret, ts))]


def _stripe_wrong(event_id: str, secret: str, ts: int) -> Request:
    body, _ = _stripe(event_id, secret, ts)
    sig = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return body, [("Stripe-Signature", f"t={ts},v1={swap_encoding(sig)}")]


def _standard(event_id: str, secret: str, ts: int) -> Request:
    body = event_body(event_id)
    return body, list(wh.sign_standard(body, secret, event_id, ts).items())


def _standard_wrong(event_id: str, secret: str, ts: int) -> Request:
    # the whsec_ text used as the key, not its base64-decoded bytes
    body = event_body(event_id)
    signed = f"{event_id}.{ts}.".encode() + body
    sig = base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()
    headers = {**wh.sign_standard(body, secret, event_id, ts), "webhook-signature": f"v1,{sig}"}
    return body, list(headers.items())


def _plain(
    sign: Callable[..., dict[str, str]], header: str, with_id: bool
) -> tuple[Callable[[str, str, int], Request], Callable[[str, str, int], Request]]:
    def make(event_id: str, secret: str, ts: int) -> Request:
        body = event_body(event_id)
        headers = sign(body, secret, event_id) if with_id else sign(body, secret)
        return body, list(headers.items())

    def wrong(event_id: str, secret: str, ts: int) -> Request:
        body, headers = make(event_id, secret, ts)
        return body, [(k, swap_encoding(v) if k == header else v) for k, v in headers]

    return make, wrong


def _github_wrong(event_id: str, secret: str, ts: int) -> Request:
    body = event_body(event_id)
    sig = wh.sign_github(body, secret, event_id)["x-hub-signature-256"].removeprefix("sha256=")
    return body, [
        ("x-hub-signature-256", "sha256=" + swap_encoding(sig)),
        ("x-github-delivery", event_id),
    ]


def _paddle(event_id: str, secret: str, ts: int) -> Request:
    body = json.dumps({"event_id": event_id, "amount": 4200}).encode()
    return body, list(wh.sign_paddle(body, secret, ts).items())


def _paddle_wrong(event_id: str, secret: str, ts: int) -> Request:
    body, headers = _paddle(event_id, secret, ts)
    sig = dict(headers)["paddle-signature"].split("h1=")[1]
    return body, [("paddle-signature", f"ts={ts};h1={swap_encoding(sig)}")]


def adyen_item(psp: str, code: str = "AUTHORISATION", success: str = "true") -> dict[str, Any]:
    return {
        "pspReference": psp,
        "originalReference": "",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": f"order:{psp}",  # a ':' the signing string escapes
        "amount": {"value": 4200, "currency": "EUR"},
        "eventCode": code,
        "success": success,
    }


def _adyen(event_id: str, secret: str, ts: int) -> Request:
    item = wh.sign_adyen_item(adyen_item(event_id), secret)
    return json.dumps(wh.adyen_batch(item)).encode(), []


def _adyen_wrong(event_id: str, secret: str, ts: int) -> Request:
    # the hex key's text used as the key, not its bytes
    item = adyen_item(event_id)
    signed = wh.adyen.signing_string(item)
    sig = base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()
    item["additionalData"] = {"hmacSignature": sig}
    return json.dumps(wh.adyen_batch(item)).encode(), []


def _toss(event_id: str, secret: str, ts: int) -> Request:
    data = {"payoutKey": event_id, "amount": 4200}
    body = json.dumps({"eventType": "payout.changed", "createdAt": iso(ts), "data": data}).encode()
    return body, list(wh.sign_toss(body, secret, iso(ts)).items())


def _toss_wrong(event_id: str, secret: str, ts: int) -> Request:
    body, headers = _toss(event_id, secret, ts)
    sig = dict(headers)["tosspayments-webhook-signature"].removeprefix("v1:")
    sent = {**dict(headers), "tosspayments-webhook-signature": "v1:" + swap_encoding(sig)}
    return body, list(sent.items())


def _std_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


_razorpay = _plain(wh.sign_razorpay, "x-razorpay-signature", with_id=True)
_checkout = _plain(wh.sign_checkout, "cko-signature", with_id=False)
_shopify = _plain(wh.sign_shopify, "x-shopify-hmac-sha256", with_id=True)
_github = _plain(wh.sign_github, "x-hub-signature-256", with_id=True)

CASES = [
    Case("stripe", wh.stripe_verifier, ("whsec_one", "whsec_two"), _stripe, _stripe_wrong,
         "stripe-signature", True),
    Case("standard", wh.standard_verifier, (_std_secret(), _std_secret()), _standard,
         _standard_wrong, "webhook-signature", True),
    Case("razorpay", wh.razorpay_verifier, ("rzp-one", "rzp-two"), *_razorpay,
         "x-razorpay-signature", False),
    Case("checkout", wh.checkout_verifier, ("cko-one", "cko-two"), *_checkout, "cko-signature",
         False),
    Case("shopify", wh.shopify_verifier, ("shp-one", "shp-two"), *_shopify,
         "x-shopify-hmac-sha256", False),
    Case("github", wh.github_verifier, ("gh-one", "gh-two"), _github[0], _github_wrong,
         "x-hub-signature-256", False),
    Case("paddle", wh.paddle_verifier, ("pdl-one", "pdl-two"), _paddle, _paddle_wrong,
         "paddle-signature", True),
    Case("adyen", wh.adyen_verifier, (secrets.token_hex(32), secrets.token_hex(32)), _adyen,
         _adyen_wrong, None, False,
         event_id_of=lambda psp: f"{psp}:AUTHORISATION:true"),
    Case("toss", wh.toss_verifier, ("toss-one", "toss-two"), _toss, _toss_wrong,
         "tosspayments-webhook-signature", True),
]  # fmt: skip


@dataclass(frozen=True)
class PayPalIdentity:
    key: rsa.RSAPrivateKey
    pem: bytes
    url: str = "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-test"


def paypal_identity(valid_from: datetime | None = None, days: int = 30) -> PayPalIdentity:
    """A key and a self-signed certificate standing in for PayPal's (no network)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "messageverificationcerts")])
    start = valid_from or datetime.now(UTC) - timedelta(days=1)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    return PayPalIdentity(key, cert.public_bytes(serialization.Encoding.PEM))


def paypal_request(
    who: PayPalIdentity, event_id: str, webhook_id: str, ts: int, transmission: str = "tx-1"
) -> Request:
    body = json.dumps({"id": event_id, "event_type": "PAYMENT.CAPTURE.COMPLETED"}).encode()
    headers = wh.sign_paypal(
        body,
        who.key,
        webhook_id=webhook_id,
        transmission_id=transmission,
        transmission_time=iso(ts).replace("+00:00", "Z"),
        cert_url=who.url,
    )
    return body, list(headers.items())
