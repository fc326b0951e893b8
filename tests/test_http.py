"""The Idempotency-Key middleware, in-process over real Postgres (httpx ASGI transport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from consumer_idem import Ambiguous, PostgresStore, Retryable, Status
from consumer_idem.http import (
    IdempotencyMiddleware,
    KeyHeaderError,
    idempotent,
    not_idempotent,
    parse_key_header,
)


def make_app(store: PostgresStore, calls: list[str]) -> Starlette:
    async def create(request: Request) -> Any:
        idem = request.state.idempotency
        data = await request.json()
        calls.append(idem.key)
        if data.get("explode"):
            raise RuntimeError("bug")
        if data.get("wait"):
            await asyncio.sleep(data["wait"])
        await idem.connection.execute(
            "INSERT INTO http_effects VALUES ($1, $2)", idem.scope, idem.key
        )
        if data.get("fail"):
            return JSONResponse({"error": "upstream"}, status_code=502)
        if data.get("reject"):
            return JSONResponse({"error": "amount too large"}, status_code=400)
        return JSONResponse(
            {"id": len(calls), "amount": data.get("amount")},
            status_code=201,
            headers={"location": f"/things/{len(calls)}", "x-debug": "no"},
        )

    async def charge(request: Request) -> Any:
        idem = request.state.idempotency
        data = await request.json()
        calls.append(idem.downstream_key)
        if data.get("refused"):
            raise Retryable("gateway refused the connection")
        if data.get("timeout"):
            raise Ambiguous("gateway read timeout")

        async def write(conn: asyncpg.Connection) -> None:
            await conn.execute("INSERT INTO http_effects VALUES ($1, $2)", idem.scope, idem.key)

        idem.add_write(write)
        return JSONResponse({"charged": True}, status_code=201)

    async def stream(request: Request) -> Any:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"chunk{i};".encode()

        calls.append("stream")
        return StreamingResponse(chunks(), media_type="text/plain")

    @not_idempotent
    async def plain(request: Request) -> Any:
        calls.append("plain")
        return JSONResponse({"ok": True})

    async def optional(request: Request) -> Any:
        calls.append("optional")
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(
        routes=[
            Route("/things", idempotent(required=True)(create), methods=["POST"]),
            Route(
                "/charges", idempotent(required=True, mode="two_phase")(charge), methods=["POST"]
            ),
            Route("/stream", idempotent()(stream), methods=["POST"]),
            Route("/plain", plain, methods=["POST"]),
            Route("/optional", optional, methods=["POST"]),
            Route("/open", idempotent(fail_open=True)(optional), methods=["POST"]),
        ]
    )
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        caller=lambda conn: conn.headers.get("x-tenant", "t0"),
    )
    return app


@pytest.fixture
async def effects_table(pg_pool: asyncpg.Pool) -> None:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS http_effects (scope text, key text)")


@pytest.fixture
async def client(store: PostgresStore, effects_table: None) -> AsyncIterator[Any]:
    calls: list[str] = []
    transport = httpx.ASGITransport(app=make_app(store, calls), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        c.calls = calls  # type: ignore[attr-defined]
        yield c


async def effects(pool: asyncpg.Pool, key: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM http_effects WHERE key = $1", key))


def test_key_header_forms() -> None:
    assert parse_key_header('"abc-1"') == parse_key_header("abc-1") == "abc-1"
    assert parse_key_header(r'"a\"b\\c"') == 'a"b\\c'
    for bad in ('"unterminated', "has space", '"\x01"', "x" * 256, '""'):
        with pytest.raises(KeyHeaderError):
            parse_key_header(bad)


async def test_missing_and_malformed_keys_are_400_problems(client: Any, scope: str) -> None:
    r = await client.post("/things", json={"amount": 1})
    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("idempotency-key-missing")
    r = await client.post("/things", json={"amount": 1}, headers={"Idempotency-Key": "a b"})
    assert r.status_code == 400 and r.json()["type"].endswith("idempotency-key-invalid")
    assert client.calls == []


async def test_first_runs_retry_replays_byte_for_byte(
    client: Any, pg_pool: asyncpg.Pool, scope: str
) -> None:
    headers = {"Idempotency-Key": f'"{scope}"'}
    first = await client.post("/things", json={"amount": 5}, headers=headers)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = await client.post(
        "/things",
        content=b'{ "amount" : 5 }',
        headers={"Idempotency-Key": scope, "content-type": "application/json"},
    )
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["location"] == first.headers["location"]
    assert "x-debug" not in again.headers  # only the chosen headers are stored
    assert len(client.calls) == 1 and await effects(pg_pool, scope) == 1


async def test_same_key_other_body_is_422(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    assert (await client.post("/things", json={"amount": 5}, headers=h)).status_code == 201
    r = await client.post("/things", json={"amount": 6}, headers=h)
    assert r.status_code == 422 and r.json()["type"].endswith("idempotency-key-reused")


async def test_keys_never_collide_across_tenants(client: Any, scope: str) -> None:
    for tenant in ("acme", "globex"):
        r = await client.post(
            "/things", json={"amount": 5}, headers={"Idempotency-Key": scope, "X-Tenant": tenant}
        )
        assert r.status_code == 201 and "idempotent-replayed" not in r.headers
    assert len(client.calls) == 2


async def test_deterministic_4xx_is_stored_and_replayed(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    first = await client.post("/things", json={"reject": True}, headers=h)
    again = await client.post("/things", json={"reject": True}, headers=h)
    assert first.status_code == again.status_code == 400
    assert again.headers["idempotent-replayed"] == "true" and len(client.calls) == 1


async def test_5xx_and_exceptions_roll_back_and_may_run_again(
    client: Any, store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    for body in ({"fail": True}, {"explode": True}):
        key = f"{scope}-{next(iter(body))}"
        r = await client.post("/things", json=body, headers={"Idempotency-Key": key})
        assert r.status_code in (500, 502)
        record = await store.get("http:t0:POST /things", key)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        assert await effects(pg_pool, key) == 0  # rolled back with the record
        r = await client.post("/things", json=body, headers={"Idempotency-Key": key})
        assert r.status_code in (500, 502) and "idempotent-replayed" not in r.headers
    assert len(client.calls) == 4


async def test_in_flight_duplicate_gets_409_with_retry_after(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    first = asyncio.create_task(client.post("/things", json={"wait": 1.0}, headers=h))
    await asyncio.sleep(0.3)
    second = await client.post("/things", json={"wait": 1.0}, headers=h)
    assert second.status_code == 409 and second.headers["retry-after"] == "1"
    assert (await first).status_code == 201
    third = await client.post("/things", json={"wait": 1.0}, headers=h)
    assert third.status_code == 201 and third.headers["idempotent-replayed"] == "true"


async def test_store_down_is_503_unless_the_route_is_fail_open(
    pg_dsn: str, effects_table: None, scope: str
) -> None:
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    calls: list[str] = []
    dead = PostgresStore(pool, command_timeout=2)
    transport = httpx.ASGITransport(app=make_app(dead, calls), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/things", json={"amount": 1}, headers={"Idempotency-Key": scope})
        assert r.status_code == 503 and r.json()["type"].endswith("store-unavailable")
        assert calls == []  # fail-closed: the endpoint never ran
        r = await c.post("/open", json={}, headers={"Idempotency-Key": scope})
        assert r.status_code == 201 and r.headers["idempotency-status"] == "bypassed"
    await pool.close()


async def test_streaming_passes_through_unstored(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    first = await client.post("/stream", json={}, headers=h)
    assert first.text == "chunk0;chunk1;chunk2;"
    assert first.headers["idempotency-stored"] == "headers-only"
    again = await client.post("/stream", json={}, headers=h)
    assert again.headers["idempotent-replayed"] == "true" and again.content == b""
    assert again.headers["idempotency-stored"] == "headers-only"
    assert client.calls.count("stream") == 1


async def test_opted_out_and_optional_routes(client: Any, scope: str) -> None:
    for _ in range(2):
        await client.post("/plain", json={}, headers={"Idempotency-Key": scope})
        await client.post("/optional", json={})  # no key, not required: just runs
    assert client.calls.count("plain") == 2 and client.calls.count("optional") == 2


async def test_two_phase_route(
    client: Any, store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    ok, refused, timeout = f"{scope}-ok", f"{scope}-ref", f"{scope}-to"
    r = await client.post("/charges", json={}, headers={"Idempotency-Key": ok})
    assert r.status_code == 201 and await effects(pg_pool, ok) == 1
    r = await client.post("/charges", json={}, headers={"Idempotency-Key": ok})
    assert r.headers["idempotent-replayed"] == "true" and await effects(pg_pool, ok) == 1
    r = await client.post("/charges", json={"refused": True}, headers={"Idempotency-Key": refused})
    assert r.status_code == 503
    rec = await store.get("http:t0:POST /charges", refused)
    assert rec is not None and rec.status is Status.FAILED_RETRYABLE
    r = await client.post("/charges", json={"timeout": True}, headers={"Idempotency-Key": timeout})
    assert r.status_code == 500
    r = await client.post("/charges", json={"timeout": True}, headers={"Idempotency-Key": timeout})
    assert r.status_code == 409 and r.json()["type"].endswith("outcome-unknown")
    assert json.loads(r.content)["status"] == 409
