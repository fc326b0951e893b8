"""The receiver around the verifiers: Adyen batches item by item, retention that outlives the
sender's retries (also through ``prune``), handler bugs logged, and problem+json answers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem import webhooks as wh
from consumer_idem.errors import ConfigurationError
from consumer_idem.webhooks import WebhookReceiver
from consumer_idem.webhooks.horizons import spoken
from tests._webhook_cases import adyen_item
from tests.conftest import unique

HMAC_KEY = secrets.token_hex(32)


async def post(receiver: WebhookReceiver, body: bytes, headers: Any = ()) -> httpx.Response:
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post("/hook", content=body, headers=list(headers))


def batch(*psps: str) -> bytes:
    items = [wh.sign_adyen_item(adyen_item(psp), HMAC_KEY) for psp in psps]
    return json.dumps(wh.adyen_batch(*items)).encode()


@pytest.fixture
async def effects(pg_pool: asyncpg.Pool) -> str:
    """A table of effects private to the test: one row per run of the handler's effect."""
    table = f"effects_{secrets.token_hex(6)}"
    await pg_pool.execute(f"CREATE TABLE {table} (psp text)")
    return table


def adyen_receiver(store: PostgresStore, table: str, fail_once: set[str]) -> WebhookReceiver:
    async def on_item(item: dict[str, Any], conn: asyncpg.Connection) -> None:
        await conn.execute(f"INSERT INTO {table} VALUES ($1)", item["pspReference"])
        if item["pspReference"] in fail_once:  # a crash after the effect, before the commit
            fail_once.discard(item["pspReference"])
            raise RuntimeError("the process died here")

    return WebhookReceiver(store, unique("adyen"), wh.adyen_verifier([HMAC_KEY]), on_item)


async def counts(pool: asyncpg.Pool, table: str) -> dict[str, int]:
    rows = await pool.fetch(f"SELECT psp, count(*) AS n FROM {table} GROUP BY psp")
    return {r["psp"]: r["n"] for r in rows}


async def test_an_adyen_batch_with_one_processed_item_runs_only_the_new_one(
    store: PostgresStore, effects: str
) -> None:
    receiver = adyen_receiver(store, effects, set())
    first = await post(receiver, batch("psp-a"))
    assert first.status_code == 200 and first.text == "[accepted]"
    both = await post(receiver, batch("psp-a", "psp-b"))
    assert both.status_code == 200 and both.text == "[accepted]"
    assert await counts(store.pool, effects) == {"psp-a": 1, "psp-b": 1}


async def test_a_crash_between_adyen_items_redelivers_the_batch_without_running_either_twice(
    store: PostgresStore, effects: str
) -> None:
    receiver = adyen_receiver(store, effects, {"psp-d"})
    crashed = await post(receiver, batch("psp-c", "psp-d"))
    assert crashed.status_code == 500, crashed.text  # not [accepted]: Adyen sends it again
    assert await counts(store.pool, effects) == {"psp-c": 1}  # the crashed item rolled back
    again = await post(receiver, batch("psp-c", "psp-d"))
    assert again.status_code == 200 and again.text == "[accepted]"
    assert await counts(store.pool, effects) == {"psp-c": 1, "psp-d": 1}


async def test_a_process_killed_between_adyen_items_redelivers_without_running_either_twice(
    store: PostgresStore, effects: str, pg_dsn: str
) -> None:
    provider = unique("adyen")
    body = batch("psp-k1", "psp-k2")
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).parent / "_adyen_crash_child.py"),
        *(pg_dsn, effects, provider, HMAC_KEY, body.decode()),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert await asyncio.wait_for(child.wait(), 60) == -signal.SIGKILL
    assert await counts(store.pool, effects) == {"psp-k1": 1}  # the second never committed

    async def on_item(item: dict[str, Any], conn: asyncpg.Connection) -> None:
        await conn.execute(f"INSERT INTO {effects} VALUES ($1)", item["pspReference"])

    receiver = WebhookReceiver(store, provider, wh.adyen_verifier([HMAC_KEY]), on_item)
    again = await post(receiver, body)  # Adyen had no answer: it sends the batch again
    assert again.status_code == 200 and again.text == "[accepted]"
    assert await counts(store.pool, effects) == {"psp-k1": 1, "psp-k2": 1}


async def test_an_adyen_item_resent_signed_with_a_rotated_key_is_a_duplicate(
    store: PostgresStore, effects: str
) -> None:
    """Adyen signs when it sends: after a key rotation, a resend of an item carries another
    hmacSignature. It is the same event, not an id reused with another payload."""
    new_key = secrets.token_hex(32)

    async def on_item(item: dict[str, Any], conn: asyncpg.Connection) -> None:
        await conn.execute(f"INSERT INTO {effects} VALUES ($1)", item["pspReference"])

    verifier = wh.adyen_verifier([HMAC_KEY, new_key])
    receiver = WebhookReceiver(store, unique("adyen"), verifier, on_item)
    for key in (HMAC_KEY, new_key):
        item = wh.sign_adyen_item(adyen_item("psp-r"), key)
        response = await post(receiver, json.dumps(wh.adyen_batch(item)).encode())
        assert response.status_code == 200 and response.text == "[accepted]", response.text
    assert await counts(store.pool, effects) == {"psp-r": 1}


async def test_a_forged_item_refuses_the_whole_adyen_batch(
    store: PostgresStore, effects: str
) -> None:
    receiver = adyen_receiver(store, effects, set())
    good = wh.sign_adyen_item(adyen_item("psp-e"), HMAC_KEY)
    forged = wh.sign_adyen_item(adyen_item("psp-f"), secrets.token_hex(32))
    response = await post(receiver, json.dumps(wh.adyen_batch(good, forged)).encode())
    assert response.status_code == 401
    assert await counts(store.pool, effects) == {}


async def test_adyen_items_differing_in_success_are_two_events(
    store: PostgresStore, effects: str
) -> None:
    receiver = adyen_receiver(store, effects, set())
    refused = wh.sign_adyen_item(adyen_item("psp-g", success="false"), HMAC_KEY)
    succeeded = wh.sign_adyen_item(adyen_item("psp-g"), HMAC_KEY)
    for item in (refused, succeeded, refused):
        response = await post(receiver, json.dumps(wh.adyen_batch(item)).encode())
        assert response.text == "[accepted]"
    assert await counts(store.pool, effects) == {"psp-g": 2}


async def test_an_adyen_item_replayed_with_unsigned_fields_changed_is_a_duplicate_not_a_500(
    store: PostgresStore, effects: str
) -> None:
    """Adyen signs eight fields of an item; the rest (``additionalData``, ``reason``, ...) can
    be changed by whoever replays a captured item, including to JSON that cannot be
    canonicalised (an integer beyond 2**53). Such a replay is the same event: answered, not
    run again, and never a 500."""
    receiver = adyen_receiver(store, effects, set())
    item = wh.sign_adyen_item(adyen_item("psp-u"), HMAC_KEY)
    first = await post(receiver, json.dumps(wh.adyen_batch(item)).encode())
    assert first.text == "[accepted]"
    for extra in ({"n": 2**64}, {"n": 1}):
        changed = {**item, "reason": "x", "additionalData": {**item["additionalData"], **extra}}
        again = await post(receiver, json.dumps(wh.adyen_batch(changed)).encode())
        assert again.status_code == 200 and again.text == "[accepted]", again.text
    assert await counts(store.pool, effects) == {"psp-u": 1}


async def test_adyen_items_whose_fields_hold_colons_are_distinct_events(
    store: PostgresStore, effects: str
) -> None:
    """pspReference ``A:B`` with eventCode ``C`` is not pspReference ``A`` with ``B:C``."""
    receiver = adyen_receiver(store, effects, set())
    one = wh.sign_adyen_item(adyen_item("A:B", code="C"), HMAC_KEY)
    other = wh.sign_adyen_item(adyen_item("A", code="B:C"), HMAC_KEY)
    response = await post(receiver, json.dumps(wh.adyen_batch(one, other)).encode())
    assert response.text == "[accepted]"
    assert await counts(store.pool, effects) == {"A:B": 1, "A": 1}


async def test_one_adyen_item_refused_or_failing_does_not_hold_back_the_batchs_others(
    store: PostgresStore, effects: str
) -> None:
    """An item reused with other signed fields (422), or whose handler fails (500), fails the
    batch, so Adyen resends it; the items after it still run now, not only once the failing
    one stops failing (a 422 never does: they would be lost after Adyen's 30 days)."""
    receiver = adyen_receiver(store, effects, {"psp-x"})
    first = wh.sign_adyen_item(adyen_item("psp-w"), HMAC_KEY)
    assert (await post(receiver, json.dumps(wh.adyen_batch(first)).encode())).status_code == 200
    reused = wh.sign_adyen_item({**adyen_item("psp-w"), "amount": {"value": 1}}, HMAC_KEY)
    later = wh.sign_adyen_item(adyen_item("psp-v"), HMAC_KEY)
    response = await post(receiver, json.dumps(wh.adyen_batch(reused, later)).encode())
    assert response.status_code == 422, response.text
    failing = wh.sign_adyen_item(adyen_item("psp-x"), HMAC_KEY)
    after = wh.sign_adyen_item(adyen_item("psp-y"), HMAC_KEY)
    response = await post(receiver, json.dumps(wh.adyen_batch(failing, after)).encode())
    assert response.status_code == 500, response.text
    assert await counts(store.pool, effects) == {"psp-w": 1, "psp-v": 1, "psp-y": 1}


# --- retention --------------------------------------------------------------------------------


async def noop(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    return None


def test_a_retention_shorter_than_the_senders_retry_horizon_is_refused_with_the_figures(
    store: PostgresStore,
) -> None:
    with pytest.raises(ConfigurationError) as info:
        WebhookReceiver(
            store, "payments", wh.adyen_verifier([HMAC_KEY]), noop, retention=timedelta(days=7)
        )
    assert "7 days" in str(info.value) and "30 days" in str(info.value)
    assert "1 day" in str(info.value)  # the margin
    # a sender named by the provider, with a verifier of one's own
    with pytest.raises(ConfigurationError, match="3 days"):
        WebhookReceiver(store, "stripe", lambda b, h: "x", noop, retention=timedelta(days=2))
    floor = wh.retention_floor("adyen")
    assert floor == timedelta(days=31)
    WebhookReceiver(store, "p", wh.adyen_verifier([HMAC_KEY]), noop, retention=floor)


def test_every_senders_default_retention_outlives_its_retries(store: PostgresStore) -> None:
    for sender, (horizon, _) in wh.RETRY_HORIZONS.items():
        receiver = WebhookReceiver(store, sender, lambda b, h: "x", noop)
        assert receiver.retention >= horizon + wh.MARGIN, sender


def test_the_guides_horizon_table_is_the_codes() -> None:
    page = (Path(__file__).parent.parent / "docs/guides/webhooks.md").read_text()
    shown = dict(
        (m[1], (m[2], m[3]))
        for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|$", page, re.M)
    )
    assert shown == {
        sender: (spoken(horizon), spoken(horizon + wh.MARGIN))
        for sender, (horizon, _) in wh.RETRY_HORIZONS.items()
    }


async def test_prune_keeps_a_webhook_record_until_the_senders_horizon_has_passed(
    pg_pool: asyncpg.Pool, store: PostgresStore
) -> None:
    """A store whose default retention is one second: the receiver's records still expire
    after Stripe's horizon plus the margin, so a prune after that second keeps them and a
    retry of the event is answered, not run again."""
    short = PostgresStore(pg_pool, retention=1)
    ran: list[str] = []

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        ran.append(event["id"])

    receiver = WebhookReceiver(short, unique("stripe"), wh.stripe_verifier(["sk"]), on_event)
    body = json.dumps({"id": unique("evt")}).encode()
    headers = {"stripe-signature": wh.sign_stripe(body, "sk", int(time.time()))}
    assert (await post(receiver, body, headers.items())).status_code == 200
    kept = await pg_pool.fetchval(
        f"SELECT expires_at - completed_at FROM {short.table} WHERE scope = $1", receiver.scope
    )
    assert kept >= wh.retention_floor("stripe")
    await asyncio.sleep(1.2)  # past the store's own retention
    report = await short.maintenance.prune(max_rows_per_s=None)
    assert report.finished
    again = await post(receiver, body, headers.items())
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert len(ran) == 1


# --- answers ----------------------------------------------------------------------------------


async def test_a_handler_bug_is_logged_with_its_traceback_and_answered_500(
    store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    async def buggy(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("amount")

    receiver = WebhookReceiver(store, unique("github"), wh.github_verifier(["gh"]), buggy)
    body = b'{"action": "opened"}'
    headers = wh.sign_github(body, "gh", unique("delivery")).items()
    with caplog.at_level(logging.ERROR, logger="consumer_idem.webhooks"):
        failed = await post(receiver, body, headers)
    assert failed.status_code == 500
    assert failed.headers["content-type"] == "application/problem+json"
    [record] = [r for r in caplog.records if r.name == "consumer_idem.webhooks"]
    assert record.exc_info is not None and "KeyError: 'amount'" in caplog.text
    retried = await post(receiver, body, headers)  # nothing was committed: the retry runs
    assert retried.status_code == 200 and len(calls) == 2
