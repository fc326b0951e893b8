"""Webhook receivers: secrets checked when the receiver is built, headers matched the way HTTP
matches them, ids of any length, and signatures compared in constant time only."""

from __future__ import annotations

import ast
import base64
import hmac
import importlib
import inspect
import pkgutil
import time
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore, webhooks
from consumer_idem.webhooks import (
    WebhookReceiver,
    WebhookVerificationError,
    sign_standard,
    sign_stripe,
    standard_verifier,
    verify_standard,
    verify_stripe,
)

BODY = b'{"id":"evt_1","type":"charge.succeeded"}'
RAW_KEY = b"secret-one-for-tests-only-123456"
PADDED = "whsec_" + base64.b64encode(RAW_KEY).decode()  # 32 bytes: one "=" of padding


def test_an_empty_secret_is_refused_when_the_receiver_is_built() -> None:
    for empty in ("whsec_", "", "whsec_===="):
        with pytest.raises(ValueError, match="empty"):
            standard_verifier([empty])


def test_a_secret_that_is_not_base64_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="base64"):
        standard_verifier(["whsec_not base64!"])


def test_a_secret_without_its_padding_is_accepted() -> None:
    assert PADDED.endswith("=")
    unpadded = PADDED.rstrip("=")
    now = int(time.time())
    headers = sign_standard(BODY, PADDED, "msg_1", now)
    assert verify_standard(BODY, headers, [unpadded]) == "msg_1"
    assert standard_verifier([unpadded])(BODY, headers) == "msg_1"


def test_plain_dict_headers_match_case_insensitively() -> None:
    now = int(time.time())
    headers = {k.title(): v for k, v in sign_standard(BODY, PADDED, "msg_1", now).items()}
    assert "Webhook-Id" in headers
    assert verify_standard(BODY, headers, [PADDED]) == "msg_1"


async def test_an_over_long_signed_id_is_processed_once_not_a_500(
    store: PostgresStore, scope: str
) -> None:
    processed: list[str] = []

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        processed.append(event["id"])

    receiver = WebhookReceiver(store, scope, standard_verifier([PADDED]), on_event)
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    long_id = "msg_" + "x" * 400
    body = b'{"id": "evt_long"}'
    headers = sign_standard(body, PADDED, long_id, int(time.time()))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        first = await c.post("/hook", content=body, headers=headers)
        dup = await c.post("/hook", content=body, headers=headers)
    assert first.status_code == 200 and first.json()["duplicate"] is False
    assert dup.status_code == 200 and dup.json()["duplicate"] is True
    assert processed == ["evt_long"]


# --- finding 9: constant time, checked two ways ----------------------------------------------


def test_every_signature_check_goes_through_compare_digest(monkeypatch: Any) -> None:
    """A mutation to ``expected == sig`` leaves verification working, so check the calls."""
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(webhooks.hmac, "compare_digest", spy)
    now = int(time.time())
    assert verify_stripe(BODY, sign_stripe(BODY, "sk", now), ["sk"]) == now
    assert len(calls) == 1
    assert verify_standard(BODY, sign_standard(BODY, PADDED, "m", now), [PADDED]) == "m"
    assert len(calls) == 2
    with pytest.raises(WebhookVerificationError):
        verify_stripe(BODY, sign_stripe(BODY, "other", now), ["sk"])
    with pytest.raises(WebhookVerificationError):
        verify_standard(BODY, sign_standard(BODY, "whsec_b3RoZXI=", "m", now), [PADDED])
    assert len(calls) == 4


def test_no_signature_is_compared_with_an_operator() -> None:
    """Lint: in the webhooks package no ``==``, ``!=``, ``in`` or ``not in`` touches a value
    whose name says it is a signature, digest or MAC (those go through
    ``hmac.compare_digest``)."""
    sources = [
        inspect.getsource(importlib.import_module(f"consumer_idem.webhooks.{m.name}"))
        for m in pkgutil.iter_modules(webhooks.__path__)
    ]
    assert len(sources) >= 12  # every module of the package: each scheme and the mechanism
    tree = ast.parse("\n".join([inspect.getsource(webhooks), *sources]))
    suspicious = ("sig", "digest", "expected", "mac", "offered")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
            continue
        names = {
            n.id if isinstance(n, ast.Name) else n.attr
            for part in (node.left, *node.comparators)
            for n in ast.walk(part)
            if isinstance(n, ast.Name | ast.Attribute)
        }
        if any(word in name.lower() for name in names for word in suspicious):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not found, found


async def test_forged_non_ascii_signatures_and_hostile_bodies_are_4xx(
    store: PostgresStore, scope: str
) -> None:
    """A forged signature with bytes outside ASCII is a 401 (never a 500 the provider retries
    for days), and a signed body nested too deep for ``json`` is a 400."""
    handled: list[Any] = []

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        handled.append(event)

    std = WebhookReceiver(store, f"{scope}-std", standard_verifier([PADDED]), on_event)
    stp = WebhookReceiver(store, f"{scope}-stripe", webhooks.stripe_verifier(["sk"]), on_event)
    app = Starlette(
        routes=[
            Route("/std", std.handle, methods=["POST"]),
            Route("/stripe", stp.handle, methods=["POST"]),
        ]
    )
    now = int(time.time())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post(
            "/std",
            content=BODY,
            headers=[
                (b"webhook-id", b"m1"),
                (b"webhook-timestamp", str(now).encode()),
                (b"webhook-signature", b"v1,\xe9\xe9"),
            ],
        )
        assert r.status_code == 401, r.text
        r = await c.post(
            "/stripe", content=BODY, headers=[(b"stripe-signature", b"t=%d,v1=\xe9" % now)]
        )
        assert r.status_code == 401, r.text
        deep = b"[" * 100_000 + b"]" * 100_000
        r = await c.post("/std", content=deep, headers=sign_standard(deep, PADDED, "m2", now))
        assert r.status_code == 400, r.text
        r = await c.post(
            "/stripe", content=deep, headers={"stripe-signature": sign_stripe(deep, "sk", now)}
        )
        assert r.status_code == 400, r.text
        listed = b'{"id": ["evt_1"]}'
        r = await c.post(
            "/stripe", content=listed, headers={"stripe-signature": sign_stripe(listed, "sk", now)}
        )
        assert r.status_code == 400, r.text
    assert handled == []
