"""``examples/gateway_webhooks.py`` from outside: a uvicorn process configured only through its
environment, on a database of its own, receiving each of the ten senders' deliveries over HTTP.
Each accepted event (each Adyen item) is one row of ``webhook_events``; a retry adds none; a
forged delivery is refused and adds none; a rotated secret is accepted."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from consumer_idem import webhooks as wh
from consumer_idem.cli.settings import Settings
from tests._webhook_cases import CASES, paypal_identity, paypal_request
from tests.conftest import ROOT_DIR, free_port, fresh_database, unique

PAYPAL = paypal_identity()
PAYPAL_WEBHOOK_ID = "WH-EXAMPLE"
#: each sender's (old, new) secrets: the example is given both, comma-separated
SECRETS = {case.name: case.secrets for case in CASES}


@pytest.fixture
async def example(settings: Settings, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """The example app on a free port and a database of its own: (its URL, the DSN)."""
    cert = tmp_path / "paypal.pem"
    cert.write_bytes(PAYPAL.pem)
    async with fresh_database(settings, "gateway_webhooks") as dsn:
        env = {
            **os.environ,
            "PYTHONPATH": ROOT_DIR,
            "CONSUMER_IDEM_PG_DSN": dsn,
            "CONSUMER_IDEM_SCHEMA": "hooks_example",
            "CONSUMER_IDEM_PAYPAL_WEBHOOK_ID": PAYPAL_WEBHOOK_ID,
            "CONSUMER_IDEM_PAYPAL_CERT_FILE": str(cert),
            **{
                f"CONSUMER_IDEM_WEBHOOK_SECRET_{name.upper()}": ",".join(pair)
                for name, pair in SECRETS.items()
            },
        }
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "uvicorn", "examples.gateway_webhooks:app", "--port", str(port)),
            *("--host", "127.0.0.1", "--log-level", "warning"),
            env=env,
            cwd=ROOT_DIR,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(150):
                    try:
                        await client.post("/webhooks/stripe")
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)
                else:
                    pytest.fail("the example did not start", pytrace=False)
            yield url, dsn
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)


def deliveries(sender: str, event_id: str, secret_index: int) -> tuple[bytes, Any]:
    now = int(time.time())
    if sender == "paypal":
        return paypal_request(PAYPAL, event_id, PAYPAL_WEBHOOK_ID, now)
    case = next(c for c in CASES if c.name == sender)
    return case.make(event_id, case.secrets[secret_index], now)


async def rows(dsn: str, sender: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetch(
            "SELECT event_id FROM webhook_events WHERE sender = $1 ORDER BY event_id", sender
        )
    finally:
        await conn.close()
    return [r["event_id"] for r in found]


SENDERS = [c.name for c in CASES] + ["paypal"]


async def test_every_sender_is_recorded_once_and_forgeries_not_at_all(
    example: tuple[str, str],
) -> None:
    url, dsn = example
    assert len(SENDERS) == 10
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for sender in SENDERS:
            path = f"/webhooks/{sender}"
            event_id = unique("evt")
            body, headers = deliveries(sender, event_id, 0)
            for _ in range(2):  # the sender retries: one row
                response = await client.post(path, content=body, headers=headers)
                assert response.status_code == 200, (sender, response.text)
            if sender == "adyen":
                assert response.text == "[accepted]"
            if sender != "paypal":  # the secret being rotated in is accepted as well
                new_body, new_headers = deliveries(sender, unique("r"), 1)
                rotated = await client.post(path, content=new_body, headers=new_headers)
                assert rotated.status_code == 200, (sender, rotated.text)
            tampered = body.replace(b"4200", b"4201").replace(b"COMPLETED", b"REFUNDED")
            forged = await client.post(path, content=tampered, headers=headers)
            assert forged.status_code == 401, (sender, forged.text)
            assert forged.headers["content-type"] == "application/problem+json"
            recorded = await rows(dsn, sender)
            assert len(recorded) == (1 if sender == "paypal" else 2), (sender, recorded)
            case = next((c for c in CASES if c.name == sender), None)
            expected = case.event_id_of(event_id) if case else event_id
            if sender != "toss":  # Toss's signed identity is derived from the event
                assert expected in recorded, (sender, recorded)


async def test_an_adyen_batch_is_one_row_per_item_and_a_crash_free_retry_adds_none(
    example: tuple[str, str],
) -> None:
    url, dsn = example
    key = SECRETS["adyen"][0]
    items = [
        wh.sign_adyen_item(
            {
                "pspReference": psp,
                "merchantAccountCode": "M",
                "merchantReference": "r",
                "amount": {"value": 1, "currency": "EUR"},
                "eventCode": "AUTHORISATION",
                "success": "true",
            },
            key,
        )
        for psp in (f"psp-{secrets.token_hex(4)}", f"psp-{secrets.token_hex(4)}")
    ]
    async with httpx.AsyncClient(base_url=url) as client:
        one = json.dumps(wh.adyen_batch(items[0])).encode()
        both = json.dumps(wh.adyen_batch(*items)).encode()
        for body in (one, both, both):
            response = await client.post("/webhooks/adyen", content=body)
            assert response.text == "[accepted]"
    recorded = await rows(dsn, "adyen")
    assert sorted(recorded) == sorted(f"{i['pspReference']}:AUTHORISATION:true" for i in items)


async def test_an_event_whose_text_holds_a_nul_character_is_recorded_not_refused_forever(
    example: tuple[str, str],
) -> None:
    """A customer's name or metadata can hold U+0000, which a ``jsonb`` column cannot: the
    example's insert failed, the event was answered 500 on every retry and never recorded."""
    url, dsn = example
    event_id = unique("evt")
    secret = SECRETS["stripe"][0]
    body = json.dumps({"id": event_id, "customer": {"name": "Ann\u0000", "note": "a\\u0000"}})
    raw = body.encode()
    headers = {"stripe-signature": wh.sign_stripe(raw, secret, int(time.time()))}
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/webhooks/stripe", content=raw, headers=headers)
    assert response.status_code == 200, response.text
    assert await rows(dsn, "stripe") == [event_id]
