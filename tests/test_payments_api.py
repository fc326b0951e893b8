"""The payments API example end to end: the API and the stand-in gateway as real servers on
loopback, the API's store on the test database."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from consumer_idem import PostgresStore, Status
from consumer_idem.webhooks import sign_standard
from examples.payments_api import create_app, payment_id_for, render
from tests.conftest import ROOT_DIR, free_port

SECRET = "whsec_" + "dGVzdC13ZWJob29rLXNlY3JldC1mb3ItY29uc3VtZXItaWRlbQ=="


async def serve(module: str, port: int, env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        cwd=ROOT_DIR,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    async with httpx.AsyncClient() as client:
        for _ in range(150):
            try:
                await client.get(
                    f"http://127.0.0.1:{port}/openapi.json"
                    if "payments_api" in module
                    else f"http://127.0.0.1:{port}/_stats"
                )
                return proc
            except httpx.TransportError:
                await asyncio.sleep(0.1)
    proc.kill()
    pytest.fail(f"{module} did not start", pytrace=False)


@pytest.fixture
async def stack(pg_dsn: str) -> AsyncIterator[dict[str, str]]:
    api_port, gw_port = free_port(), free_port()
    api, gw = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gw_port}"
    gateway = await serve(
        "examples.fake_gateway:app",
        gw_port,
        {
            "GATEWAY_WEBHOOK_URL": f"{api}/webhooks/gateway",
            "GATEWAY_WEBHOOK_SECRET": SECRET,
        },
    )
    server = await serve(
        "examples.payments_api:app",
        api_port,
        {
            "CONSUMER_IDEM_PG_DSN": pg_dsn,
            "GATEWAY_URL": gw,
            "GATEWAY_WEBHOOK_SECRET": SECRET,
        },
    )
    yield {"api": api, "gateway": gw}
    for proc in (server, gateway):
        proc.kill()
        await proc.wait()


def payment(amount: int = 1000) -> dict[str, Any]:
    return {"customer_id": "c-1", "amount_cents": amount, "currency": "EUR"}


async def charges(gateway: str) -> int:
    async with httpx.AsyncClient() as c:
        return int((await c.get(f"{gateway}/_stats")).json()["charges"])


async def test_hundred_concurrent_posts_one_key_charge_once(stack: dict[str, str]) -> None:
    key = f"k-{uuid.uuid4().hex}"
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=stack["api"], limits=limits, timeout=30) as c:
        responses = await asyncio.gather(
            *(
                c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
                for _ in range(100)
            )
        )
        final = await c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {201, 409}, statuses
    assert final.status_code == 201
    assert all(r.content == final.content for r in responses if r.status_code == 201)
    assert all(r.headers["retry-after"] for r in responses if r.status_code == 409)
    assert await charges(stack["gateway"]) == 1


async def test_missing_key_mismatch_and_byte_identical_replay(stack: dict[str, str]) -> None:
    key = f"k-{uuid.uuid4().hex}"
    async with httpx.AsyncClient(base_url=stack["api"]) as c:
        missing = await c.post("/payments", json=payment())
        assert missing.status_code == 400
        assert missing.headers["content-type"] == "application/problem+json"
        first = await c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
        assert first.status_code == 201
        replay = await c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
        assert replay.content == first.content and replay.headers["idempotent-replayed"] == "true"
        other = await c.post("/payments", json=payment(2000), headers={"Idempotency-Key": key})
        assert other.status_code == 422
        declined = await c.post(
            "/payments", json=payment(1013), headers={"Idempotency-Key": key + "-d"}
        )
        again = await c.post(
            "/payments", json=payment(1013), headers={"Idempotency-Key": key + "-d"}
        )
        assert declined.status_code == again.status_code == 402
        assert again.content == declined.content
    assert await charges(stack["gateway"]) == 2


async def test_gateway_timeout_after_charging_is_settled_by_its_webhook(
    stack: dict[str, str], store: PostgresStore, pg_pool: asyncpg.Pool
) -> None:
    key = f"k-{uuid.uuid4().hex}"
    scope = "http:public:POST /payments"
    async with httpx.AsyncClient(base_url=stack["api"], timeout=30) as c:
        await c.post(f"{stack['gateway']}/_faults", json={"timeout_after_charge": 1})
        first = await c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
        assert first.status_code == 500  # the gateway took the money and never answered
        record = await store.get(scope, key)
        assert record is not None and record.status in (Status.UNKNOWN, Status.COMPLETED)
        deadline = time.monotonic() + 30
        while (await store.get(scope, key)).status is not Status.COMPLETED:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the webhook never settled the payment"
            await asyncio.sleep(0.2)
        retry = await c.post("/payments", json=payment(), headers={"Idempotency-Key": key})
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    payment_id = payment_id_for(scope, key)
    assert retry.content == render(payment_id, "succeeded")
    assert await charges(stack["gateway"]) == 1
    assert (
        await pg_pool.fetchval(
            "SELECT count(*) FROM api_payments WHERE payment_id = $1", payment_id
        )
        == 1
    )


async def test_store_down_is_503_and_nothing_is_charged(gateway_url: str) -> None:
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    app = create_app(store=PostgresStore(pool, command_timeout=2), gateway_url=gateway_url)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
        r = await c.post("/payments", json=payment(), headers={"Idempotency-Key": "k-down"})
    await pool.close()
    assert r.status_code == 503 and r.headers["retry-after"]
    assert await charges(gateway_url) == 0


async def test_forged_stale_and_duplicate_webhooks(
    stack: dict[str, str], store: PostgresStore
) -> None:
    event = {
        "id": f"evt_{uuid.uuid4().hex[:12]}",
        "type": "charge.succeeded",
        "data": {"metadata": {}, "amount_cents": 1, "currency": "EUR", "charge_id": "ch"},
    }
    body = json.dumps(event).encode()
    now = int(time.time())
    url = f"{stack['api']}/webhooks/gateway"
    async with httpx.AsyncClient() as c:
        unsigned = await c.post(url, content=body)
        assert unsigned.status_code == 400
        forged = sign_standard(
            body, "whsec_" + "Zm9yZ2VkLXNlY3JldC1ub3QtdGhlLXJlYWwtb25l", event["id"], now
        )
        assert (await c.post(url, content=body, headers=forged)).status_code == 401
        stale = sign_standard(body, SECRET, event["id"], now - 600)
        assert (await c.post(url, content=body, headers=stale)).status_code == 401
        assert await store.get("webhook:gateway", event["id"]) is None  # nothing stored
        good = sign_standard(body, SECRET, event["id"], now)
        first = await c.post(url, content=body, headers=good)
        dup = await c.post(url, content=body, headers=good)
    assert first.status_code == dup.status_code == 200
    assert first.json()["duplicate"] is False and dup.json()["duplicate"] is True
    record = await store.get("webhook:gateway", event["id"])
    assert record is not None and record.status is Status.COMPLETED


async def test_schemathesis_finds_no_server_errors(stack: dict[str, str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{stack['api']}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        "30",
        "--seed",
        "1",
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        cwd=ROOT_DIR,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, out.decode()[-4000:]
