"""PayPal verified offline with a certificate made here (no network), and Toss's unsigned
payment events verified by re-reading the payment."""

from __future__ import annotations

import base64
import json
import time
import zlib
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem import webhooks as wh
from consumer_idem.webhooks import WebhookReceiver, WebhookSecretError
from tests._webhook_cases import PayPalIdentity, paypal_identity, paypal_request
from tests.conftest import unique

WEBHOOK_ID = "WH-ID-1"


class PayPalEndpoint:
    def __init__(self, store: PostgresStore, who: PayPalIdentity, ids: list[str] | None = None):
        self.fetched: list[str] = []
        self.ran: list[str] = []
        self.who = who

        async def fetch(url: str) -> bytes:
            self.fetched.append(url)
            return who.pem

        async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
            self.ran.append(event["id"])

        self.store = store
        verifier = wh.paypal_verifier(ids or [WEBHOOK_ID], fetch)
        self.receiver = WebhookReceiver(store, unique("paypal"), verifier, on_event)

    async def post(self, body: bytes, headers: Any) -> httpx.Response:
        return await _post(self.receiver, body, headers)

    async def refused(self, body: bytes, headers: Any, status: int) -> None:
        response = await self.post(body, headers)
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/problem+json"
        sql = f"SELECT count(*) FROM {self.store.table} WHERE scope = $1"
        assert self.ran == [] and await self.store.pool.fetchval(sql, self.receiver.scope) == 0


async def _post(receiver: WebhookReceiver, body: bytes, headers: Any) -> httpx.Response:
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post("/hook", content=body, headers=list(headers))


@pytest.fixture(scope="module")
def who() -> PayPalIdentity:
    return paypal_identity()


async def test_a_paypal_event_runs_once_across_retransmissions(
    store: PostgresStore, who: PayPalIdentity
) -> None:
    end = PayPalEndpoint(store, who)
    event_id, now = unique("WH"), int(time.time())
    first = await end.post(*paypal_request(who, event_id, WEBHOOK_ID, now, "tx-1"))
    # a retry is a new transmission (id, time, signature) of the same event
    retry = await end.post(*paypal_request(who, event_id, WEBHOOK_ID, now + 60, "tx-2"))
    assert first.status_code == 200 and retry.status_code == 200
    assert retry.json()["duplicate"] is True and end.ran == [event_id]
    assert end.fetched == [who.url]  # fetched once, then cached


async def test_a_paypal_webhook_id_being_replaced_is_accepted(
    store: PostgresStore, who: PayPalIdentity
) -> None:
    end = PayPalEndpoint(store, who, ["WH-OLD", "WH-NEW"])
    for webhook_id in ("WH-OLD", "WH-NEW"):
        request = paypal_request(who, unique("WH"), webhook_id, int(time.time()), unique("tx"))
        response = await end.post(*request)
        assert response.status_code == 200, response.text
    assert len(end.ran) == 2


async def test_forged_and_malformed_paypal_transmissions_are_refused(
    store: PostgresStore, who: PayPalIdentity
) -> None:
    now = int(time.time())
    end = PayPalEndpoint(store, who)
    body, headers = paypal_request(who, unique("WH"), WEBHOOK_ID, now)
    sent = dict(headers)
    await end.refused(body.replace(b"COMPLETED", b"REFUNDED"), headers, 401)  # tampered
    await end.refused(*paypal_request(who, unique("WH"), "WH-OTHER", now), 401)  # other webhook
    other = paypal_identity()  # signed by a key that is not the certificate's
    await end.refused(*paypal_request(other, unique("WH"), WEBHOOK_ID, now), 401)
    hexed = base64.b64decode(sent["paypal-transmission-sig"]).hex()  # wrong encoding
    await end.refused(body, {**sent, "paypal-transmission-sig": hexed}.items(), 401)
    for offset in (-400, 400):  # stale, future
        await end.refused(*paypal_request(who, unique("WH"), WEBHOOK_ID, now + offset), 401)
    for name in sent:  # each header missing
        await end.refused(body, [(k, v) for k, v in headers if k != name], 400)
    await end.refused(
        body, [*headers, ("paypal-transmission-sig", sent["paypal-transmission-sig"])], 400
    )
    raw = [(k.encode(), v.encode()) for k, v in headers if k != "paypal-transmission-sig"]
    await end.refused(body, [*raw, (b"paypal-transmission-sig", b"\xe9" * 40)], 401)
    await end.refused(body, {**sent, "paypal-auth-algo": "SHA1withRSA"}.items(), 400)


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.example/cert.pem",
        "http://api.paypal.com/cert.pem",
        "https://api.paypal.com.evil.example/cert.pem",
        "https://user@api.paypal.com/cert.pem",
        "https://api.paypal.com:8443/cert.pem",
    ],
)
async def test_a_certificate_url_off_paypals_hosts_is_never_fetched(
    store: PostgresStore, who: PayPalIdentity, url: str
) -> None:
    end = PayPalEndpoint(store, who)
    body, headers = paypal_request(who, unique("WH"), WEBHOOK_ID, int(time.time()))
    await end.refused(body, {**dict(headers), "paypal-cert-url": url}.items(), 401)
    assert end.fetched == []


@pytest.mark.parametrize(
    "url",
    [
        "https://api.paypal.com:abc/cert.pem",  # a port that is no number
        "https://api.paypal.com:99999/cert.pem",  # a port out of range
        "https://[api.paypal.com/cert.pem",  # an unclosed IPv6 bracket
    ],
)
async def test_a_malformed_certificate_url_is_a_401_never_a_500(
    store: PostgresStore, who: PayPalIdentity, url: str
) -> None:
    end = PayPalEndpoint(store, who)
    body, headers = paypal_request(who, unique("WH"), WEBHOOK_ID, int(time.time()))
    await end.refused(body, {**dict(headers), "paypal-cert-url": url}.items(), 401)
    assert end.fetched == []


def same_crc32(body: bytes, prefix: bytes, suffix: bytes, pad: int = 64) -> bytes:
    """``prefix + <pad chars 'a'/'b'> + suffix`` with ``body``'s CRC32: CRC32 is affine over
    GF(2), so the choice of 'a' or 'b' at each place is a linear system, solved here."""
    start = prefix + b"a" * pad + suffix
    flips = []  # what turning place i from 'a' into 'b' does to the CRC
    for i in range(pad):
        turned = bytearray(start)
        turned[len(prefix) + i] = ord("b")
        flips.append(zlib.crc32(bytes(turned)) ^ zlib.crc32(start))
    basis: list[tuple[int, int]] = []  # (vector, the places it is made of), reduced
    for i, vector in enumerate(flips):
        places = 1 << i
        for b_vector, b_places in basis:
            if vector ^ b_vector < vector:
                vector, places = vector ^ b_vector, places ^ b_places
        if vector:
            basis = sorted([*basis, (vector, places)], reverse=True)
    want, places = zlib.crc32(body) ^ zlib.crc32(start), 0
    for b_vector, b_places in basis:
        if want ^ b_vector < want:
            want, places = want ^ b_vector, places ^ b_places
    assert want == 0
    forged = prefix + bytes(98 if places >> i & 1 else 97 for i in range(pad)) + suffix
    assert zlib.crc32(forged) == zlib.crc32(body)
    return forged


async def test_a_captured_paypal_transmission_with_another_body_of_the_same_crc32_is_refused(
    store: PostgresStore, who: PayPalIdentity
) -> None:
    """PayPal signs the body's CRC32, not the body: whoever saw one transmission (a proxy's
    log) can, within the tolerance, send a body of their own with the same CRC32 and the same
    headers. The transmission is bound to the body it came with: the forged one is refused."""
    end = PayPalEndpoint(store, who)
    body, headers = paypal_request(who, "WH-GENUINE", WEBHOOK_ID, int(time.time()), unique("tx"))
    assert (await end.post(body, headers)).status_code == 200
    forged = same_crc32(body, b'{"id": "WH-FORGED", "event_type": "REFUND", "pad": "', b'"}')
    response = await end.post(forged, headers)
    assert response.status_code == 401, response.text
    assert end.ran == ["WH-GENUINE"]
    again = await end.post(body, headers)  # the same transmission resent: still answered
    assert again.status_code == 200 and again.json()["duplicate"] is True


async def test_an_expired_certificate_does_not_verify(store: PostgresStore) -> None:
    old = paypal_identity(valid_from=datetime.now(UTC) - timedelta(days=60), days=30)
    end = PayPalEndpoint(store, old)
    await end.refused(*paypal_request(old, unique("WH"), WEBHOOK_ID, int(time.time())), 401)


async def test_a_certificate_that_cannot_be_fetched_is_a_503(
    store: PostgresStore, who: PayPalIdentity
) -> None:
    async def down(url: str) -> bytes:
        raise ConnectionError("no route")

    receiver = WebhookReceiver(store, unique("paypal"), wh.paypal_verifier(["WH"], down), noop)
    response = await _post(receiver, *paypal_request(who, "WH-1", "WH", int(time.time())))
    assert response.status_code == 503


def test_an_empty_paypal_webhook_id_refuses_to_start() -> None:
    for bad in ([""], [], "WH-1"):
        with pytest.raises(WebhookSecretError):
            wh.paypal_verifier(bad, lambda url: None)  # type: ignore[arg-type, return-value]


async def noop(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    return None


# --- Toss: unsigned payment events --------------------------------------------------------------


def payment_event(key: str, status: str = "DONE", amount: int = 1000) -> bytes:
    data = {"paymentKey": key, "status": status, "totalAmount": amount}
    return json.dumps(
        {"eventType": "PAYMENT_STATUS_CHANGED", "createdAt": "2026-11-27T10:00:00", "data": data}
    ).encode()


async def test_an_unsigned_toss_payment_event_runs_on_the_payment_re_read_from_toss(
    store: PostgresStore,
) -> None:
    gateway = {"pay_1": {"paymentKey": "pay_1", "status": "DONE", "totalAmount": 1000}}
    seen: list[dict[str, Any]] = []

    async def fetch_payment(key: str) -> dict[str, Any]:
        return gateway[key]

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        seen.append(event["data"])

    verifier = wh.toss_verifier(["toss-key"], fetch_payment=fetch_payment)
    receiver = WebhookReceiver(store, unique("toss"), verifier, on_event)
    # the event claims another amount: the handler gets what Toss says
    forged = payment_event("pay_1", amount=999_999)
    assert (await _post(receiver, forged, [])).status_code == 200
    again = await _post(receiver, payment_event("pay_1"), [])
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert seen == [gateway["pay_1"]]
    gateway["pay_1"] = {**gateway["pay_1"], "status": "CANCELED"}  # a new status: a new event
    assert (await _post(receiver, payment_event("pay_1", "CANCELED"), [])).status_code == 200
    assert [d["status"] for d in seen] == ["DONE", "CANCELED"]


async def test_unsigned_toss_events_without_a_way_to_verify_them_are_refused(
    store: PostgresStore,
) -> None:
    async def unknown(key: str) -> dict[str, Any]:
        return {}

    plain = WebhookReceiver(store, unique("toss"), wh.toss_verifier(["k"]), noop)
    assert (await _post(plain, payment_event("pay_2"), [])).status_code == 401
    fetching = WebhookReceiver(
        store, unique("toss"), wh.toss_verifier(["k"], fetch_payment=unknown), noop
    )
    assert (await _post(fetching, payment_event("pay_2"), [])).status_code == 401
    payout = json.dumps({"eventType": "payout.changed", "createdAt": "x", "data": {}}).encode()
    assert (await _post(fetching, payout, [])).status_code == 400  # no signature, no payment


async def test_a_signed_toss_event_whose_data_json_cannot_canonicalise_runs_once_not_a_500(
    store: PostgresStore,
) -> None:
    """The identity of a signed Toss event digests its ``data``; an integer beyond 2**53 (or a
    float JSON cannot write) has no RFC 8785 form, and must still be one event, not a 500."""
    ran: list[Any] = []

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        ran.append(event["data"])

    receiver = WebhookReceiver(store, unique("toss"), wh.toss_verifier(["toss-key"]), on_event)
    data = {"payoutId": "po_1", "amount": 2**64}
    body = json.dumps({"eventType": "payout.changed", "createdAt": "c1", "data": data}).encode()
    for _ in range(2):
        headers = wh.sign_toss(body, "toss-key", datetime.now(UTC).isoformat())
        response = await _post(receiver, body, headers.items())
        assert response.status_code == 200, response.text
    assert ran == [data]


@pytest.mark.parametrize("tolerance", [0, -1, float("nan"), float("inf")])
def test_a_paypal_tolerance_that_would_accept_any_time_or_none_refuses_to_start(
    tolerance: float,
) -> None:
    """NaN compares false with everything: a NaN tolerance accepted every transmission time,
    so a seen transmission could be replayed for ever (the HMAC verifiers refused it)."""
    with pytest.raises(WebhookSecretError):
        wh.paypal_verifier(["WH"], lambda url: None, tolerance=tolerance)  # type: ignore[arg-type, return-value]
    with pytest.raises(WebhookSecretError):
        wh.stripe_verifier(["whsec_x"], tolerance=tolerance)
