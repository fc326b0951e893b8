"""Every sender's scheme through a real receiver on the real store: signatures made with the
documented algorithm are accepted once, everything forged or malformed is refused with the
right status and nothing recorded, rotated secrets are accepted, and a redelivery is answered
without running the effect again. The senders' published examples are checked at the end."""

from __future__ import annotations

import json
import time
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem import webhooks as wh
from consumer_idem.webhooks import WebhookReceiver, WebhookSecretError
from tests._webhook_cases import CASES, Case, Headers
from tests.conftest import unique

TOLERANCE = wh.DEFAULT_TOLERANCE


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


class Endpoint:
    """A receiver for one case, the events its handler ran, and the records of its scope."""

    def __init__(self, store: PostgresStore, case: Case, secrets: list[str] | None = None):
        self.store = store
        self.ran: list[str] = []

        async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
            await conn.execute("SELECT 1")
            self.ran.append(json.dumps(event, sort_keys=True))

        verifier = case.verifier(secrets or [case.secrets[0]])
        self.receiver = WebhookReceiver(store, unique(case.name), verifier, on_event)
        app = Starlette(routes=[Route("/hook", self.receiver.handle, methods=["POST"])])
        self.transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def post(
        self, body: bytes, headers: Headers | list[tuple[bytes, bytes]]
    ) -> httpx.Response:
        async with httpx.AsyncClient(transport=self.transport, base_url="http://t") as client:
            return await client.post("/hook", content=body, headers=headers)

    async def records(self) -> int:
        sql = f"SELECT count(*) FROM {self.store.table} WHERE scope = $1"
        return int(await self.store.pool.fetchval(sql, self.receiver.scope))

    async def refused(self, body: bytes, headers: Any, status: int) -> httpx.Response:
        response = await self.post(body, headers)
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"].startswith("urn:consumer-idem:problem:webhook-")
        assert self.ran == [] and await self.records() == 0
        return response


def accepted(case: Case, response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    if case.name == "adyen":
        assert response.text == "[accepted]"


async def test_a_signed_event_runs_once_and_a_redelivery_is_answered_without_running(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    first = await end.post(body, headers)
    again = await end.post(body, headers)
    accepted(case, first)
    accepted(case, again)
    if case.name != "adyen":
        assert first.json()["duplicate"] is False and again.json()["duplicate"] is True
    assert len(end.ran) == 1 and await end.records() == 1


async def test_a_rotated_secret_is_accepted_beside_the_current_one(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case, list(case.secrets))
    now = int(time.time())
    for secret in case.secrets:
        accepted(case, await end.post(*case.make(unique("evt"), secret, now)))
    assert len(end.ran) == 2


async def test_a_tampered_body_is_refused_and_nothing_recorded(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    assert b"4200" in body
    await end.refused(body.replace(b"4200", b"4201"), headers, 401)


async def test_a_wrong_secret_is_refused_and_nothing_recorded(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    await end.refused(*case.make(unique("evt"), case.secrets[1], int(time.time())), 401)


async def test_a_signature_in_the_wrong_key_or_digest_encoding_is_refused(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    await end.refused(*case.wrong_encoding(unique("evt"), case.secrets[0], int(time.time())), 401)


@pytest.mark.parametrize("offset", [-(TOLERANCE + 5), TOLERANCE + 5], ids=["stale", "future"])
async def test_a_signed_time_outside_the_tolerance_is_refused(
    store: PostgresStore, case: Case, offset: int
) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()) + offset)
    if case.signed_time:
        await end.refused(body, headers, 401)
    else:  # no timestamp is signed: an old delivery (a retry days later) still verifies
        accepted(case, await end.post(body, headers))


async def test_a_missing_signature_is_a_400_and_nothing_recorded(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    if case.header is None:  # Adyen: the signature is in each item
        batch = json.loads(body)
        del batch["notificationItems"][0]["NotificationRequestItem"]["additionalData"]
        body = json.dumps(batch).encode()
    headers = [(k, v) for k, v in headers if k.lower() != case.header]
    response = await end.refused(body, headers, 400)
    assert (case.header or "hmacSignature") in response.json()["detail"]


async def test_a_duplicated_signature_header_is_a_400_and_nothing_recorded(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    if case.header is None:  # Adyen signs in each item: a signature given twice is no string
        batch = json.loads(body)
        extra = batch["notificationItems"][0]["NotificationRequestItem"]["additionalData"]
        extra["hmacSignature"] = [extra["hmacSignature"]] * 2
        response = await end.refused(json.dumps(batch).encode(), headers, 400)
        assert "more than once" in response.json()["detail"]
        return
    twice = [*headers, *[(k, v) for k, v in headers if k.lower() == case.header]]
    response = await end.refused(body, twice, 400)
    assert "more than once" in response.json()["detail"]


async def test_a_non_ascii_signature_is_a_401_never_a_500(store: PostgresStore, case: Case) -> None:
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    if case.header is None:
        batch = json.loads(body)
        batch["notificationItems"][0]["NotificationRequestItem"]["additionalData"] = {
            "hmacSignature": "é" * 44
        }
        await end.refused(json.dumps(batch).encode(), headers, 401)
        return
    raw = [(k.encode(), v.encode()) for k, v in headers if k.lower() != case.header]
    value = dict(headers)[next(k for k, _ in headers if k.lower() == case.header)]
    forged = value[: len(value) - 8].encode() + b"\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9"
    await end.refused(body, [*raw, (case.header.encode(), forged)], 401)


async def test_an_empty_or_malformed_secret_refuses_to_start(case: Case) -> None:
    for bad in ([""], ["   "], [], "one-secret-as-a-str"):
        with pytest.raises(WebhookSecretError):
            case.verifier(bad)  # type: ignore[arg-type]
    if case.name == "adyen":
        with pytest.raises(WebhookSecretError, match="hexadecimal"):
            case.verifier(["not hex"])
    if case.name == "standard":
        with pytest.raises(WebhookSecretError, match="base64"):
            case.verifier(["whsec_not base64!"])


async def test_a_signed_body_that_is_not_the_senders_format_is_a_400_naming_it(
    store: PostgresStore, case: Case
) -> None:
    end = Endpoint(store, case)
    now = int(time.time())
    if case.name == "adyen":
        secret = case.secrets[0]
        response = await end.refused(b'{"live": "false"}', [], 400)
        assert "notificationItems" in response.json()["detail"]
        item = wh.sign_adyen_item({"success": "true", "eventCode": "AUTHORISATION"}, secret)
        response = await end.refused(json.dumps(wh.adyen_batch(item)).encode(), [], 400)
        assert "pspReference" in response.json()["detail"]
        return
    _, headers = case.make("evt_x", case.secrets[0], now)
    # the same headers re-signed over a body that is not JSON
    resigned = _resign(case, b"not json", headers, now)
    response = await end.refused(b"not json", resigned, 400)
    assert response.json()["detail"] == "the body is not JSON"


def _resign(case: Case, body: bytes, headers: Headers, now: int) -> Headers:
    secret = case.secrets[0]
    time_header = "tosspayments-webhook-transmission-time"
    signed: dict[str, Any] = {
        "stripe": lambda: {"stripe-signature": wh.sign_stripe(body, secret, now)},
        "standard": lambda: wh.sign_standard(body, secret, "evt_x", now),
        "razorpay": lambda: wh.sign_razorpay(body, secret, "evt_x"),
        "checkout": lambda: wh.sign_checkout(body, secret),
        "shopify": lambda: wh.sign_shopify(body, secret, "evt_x"),
        "github": lambda: wh.sign_github(body, secret, "evt_x"),
        "paddle": lambda: wh.sign_paddle(body, secret, now),
        "toss": lambda: wh.sign_toss(body, secret, dict(headers)[time_header]),
    }
    return list(signed[case.name]().items())


async def test_an_event_without_its_identity_is_a_400_naming_the_field(
    store: PostgresStore,
) -> None:
    end = Endpoint(store, CASES[0])  # Stripe: the id is in the body
    body = b'{"type": "charge.succeeded"}'
    headers = [("stripe-signature", wh.sign_stripe(body, CASES[0].secrets[0], int(time.time())))]
    response = await end.refused(body, headers, 400)
    assert response.json()["detail"] == "the Stripe event has no 'id' field"


# --- the senders' published examples ----------------------------------------------------------


def test_githubs_published_example_verifies() -> None:
    """The test values of GitHub's "Validating webhook deliveries" page
    (https://docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries)."""
    verifier = wh.github_verifier(["It's a Secret to Everybody"])
    headers = {
        "x-hub-signature-256": (
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        ),
        "x-github-delivery": "d-1",
    }
    verifier.check(b"Hello, World!", headers)
    with pytest.raises(wh.WebhookVerificationError):
        verifier.check(b"Hello, World?", headers)


def test_adyens_published_example_verifies() -> None:
    """The item of Adyen's HMAC page
    (https://docs.adyen.com/development-resources/webhooks/verify-hmac-signatures): its field
    values and signing string, with the example key and signature Adyen's own libraries test."""
    item = {
        "pspReference": "7914073381342284",
        "originalReference": "",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": "TestPayment-1407325143704",
        "amount": {"value": 1130, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "success": "true",
        "additionalData": {"hmacSignature": "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},
    }
    assert wh.adyen.signing_string(item) == (
        b"7914073381342284::TestMerchant:TestPayment-1407325143704:1130:EUR:AUTHORISATION:true"
    )
    verifier = wh.adyen_verifier(
        ["44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"]
    )
    verifier.verify_item(item)
    with pytest.raises(wh.WebhookVerificationError):
        verifier.verify_item({**item, "amount": {"value": 1131, "currency": "EUR"}})


def test_adyen_escapes_backslash_and_colon_and_keeps_empty_fields() -> None:
    item = {"pspReference": "a:b", "merchantReference": "c\\d", "success": True}
    assert wh.adyen.signing_string(item) == b"a\\:b:::c\\\\d::::true"


@pytest.mark.parametrize(
    ("name", "header"),
    [
        ("standard", "webhook-id"),
        ("razorpay", "x-razorpay-event-id"),
        ("shopify", "x-shopify-webhook-id"),
        ("github", "x-github-delivery"),
    ],
)
async def test_a_missing_identity_header_is_a_400_naming_it(
    store: PostgresStore, name: str, header: str
) -> None:
    case = next(c for c in CASES if c.name == name)
    end = Endpoint(store, case)
    body, headers = case.make(unique("evt"), case.secrets[0], int(time.time()))
    response = await end.refused(body, [(k, v) for k, v in headers if k.lower() != header], 400)
    assert response.json()["detail"] == f"the {header} header is missing"
