"""``wait``: a duplicate that meets the first request in flight waits for its result instead of
a 409, without holding a database connection while it waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, idempotent


def make_app(store: PostgresStore, runs: list[str], **middleware: Any) -> Starlette:
    async def slow(request: Request) -> JSONResponse:
        data = await request.json()
        runs.append(data.get("tag", "x"))
        await asyncio.sleep(data.get("sleep", 0))
        if data.get("fail") and len(runs) == 1:
            return JSONResponse({"error": "upstream"}, status_code=503)
        return JSONResponse({"run": len(runs)}, status_code=201)

    def endpoint() -> Any:  # one function per route: options are marked on the function
        async def handle(request: Request) -> JSONResponse:
            return await slow(request)

        return handle

    app = Starlette(
        routes=[
            Route("/wait", idempotent(wait=5)(endpoint()), methods=["POST"]),
            Route("/short", idempotent(wait=0.5)(endpoint()), methods=["POST"]),
            Route(
                "/two-phase",
                idempotent(wait=5, mode="two_phase")(endpoint()),
                methods=["POST"],
            ),
            Route("/default", endpoint(), methods=["POST"]),
            Route("/open", idempotent(wait=5, fail_open=True)(endpoint()), methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True, **middleware)
    return app


@pytest.fixture
async def client(store: PostgresStore) -> AsyncIterator[Any]:
    runs: list[str] = []
    transport = httpx.ASGITransport(app=make_app(store, runs), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
        c.runs = runs  # type: ignore[attr-defined]
        yield c


async def timed(coro: Any) -> tuple[httpx.Response, float]:
    response = await coro
    return response, time.monotonic()


@pytest.mark.parametrize("route", ["/wait", "/two-phase"])
async def test_a_waiting_duplicate_gets_the_first_result(
    client: Any, scope: str, route: str
) -> None:
    h = {"Idempotency-Key": scope}
    body = {"sleep": 0.8}  # longer than the claim's lock timeout: the duplicate lets go and waits
    first = asyncio.create_task(timed(client.post(route, json=body, headers=h)))
    await asyncio.sleep(0.1)
    dup, dup_done = await timed(client.post(route, json=body, headers=h))
    one, one_done = await first
    assert one.status_code == dup.status_code == 201
    assert dup.headers["idempotent-replayed"] == "true" and dup.content == one.content
    assert dup_done - one_done < 0.2, "the waiter was not woken when the first completed"
    assert client.runs == ["x"]


async def test_the_wait_runs_out_with_a_409(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    first = asyncio.create_task(client.post("/short", json={"sleep": 1.5}, headers=h))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    dup = await client.post("/short", json={"sleep": 1.5}, headers=h)
    waited = time.monotonic() - started
    assert dup.status_code == 409 and dup.headers["retry-after"]
    assert 0.4 < waited < 1.2
    assert (await first).status_code == 201 and client.runs == ["x"]


async def test_when_the_first_fails_the_waiter_runs_it(client: Any, scope: str) -> None:
    h = {"Idempotency-Key": scope}
    body = {"sleep": 0.6, "fail": True}
    first = asyncio.create_task(client.post("/wait", json=body, headers=h))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    dup = await client.post("/wait", json=body, headers=h)
    assert (await first).status_code == 503
    assert dup.status_code == 201 and "idempotent-replayed" not in dup.headers
    assert time.monotonic() - started < 1.5  # woken by the failure, not by the end of the wait
    assert len(client.runs) == 2


async def test_the_middleware_default_applies_to_every_route(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []
    app = make_app(store, runs, wait=5)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
        h = {"Idempotency-Key": scope}
        first = asyncio.create_task(c.post("/default", json={"sleep": 0.6}, headers=h))
        await asyncio.sleep(0.1)
        dup = await c.post("/default", json={"sleep": 0.6}, headers=h)
        assert (await first).status_code == 201
    assert dup.status_code == 201 and dup.headers["idempotent-replayed"] == "true"
    assert runs == ["x"]


async def test_waiters_hold_no_connection(pg_dsn: str, store: PostgresStore, scope: str) -> None:
    """Four duplicates wait on a pool of three: the first holds one connection, the listener
    one; an unrelated request still gets the third at once (a waiter blocked in a lock wait, or
    idle in a transaction, would hold it until the first finished)."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=3)
    assert pool is not None
    small = PostgresStore(pool, command_timeout=10)
    runs: list[str] = []
    transport = httpx.ASGITransport(app=make_app(small, runs), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            h = {"Idempotency-Key": scope}
            first = asyncio.create_task(c.post("/wait", json={"sleep": 2.0}, headers=h))
            await asyncio.sleep(0.1)
            waiters = [
                asyncio.create_task(c.post("/wait", json={"sleep": 2.0}, headers=h))
                for _ in range(4)
            ]
            await asyncio.sleep(0.8)  # past the lock timeout: every waiter has let go
            started = time.monotonic()
            other = await c.post(
                "/wait", json={"tag": "other"}, headers={"Idempotency-Key": scope + "-other"}
            )
            elapsed = time.monotonic() - started
            results = await asyncio.gather(first, *waiters)
    finally:
        await pool.close()
    assert other.status_code == 201 and elapsed < 0.5, elapsed
    assert [r.status_code for r in results] == [201] * 5
    assert all(r.headers.get("idempotent-replayed") == "true" for r in results[1:])
    assert runs == ["x", "other"]


async def test_a_waiter_never_falls_open(pg_dsn: str, store: PostgresStore, scope: str) -> None:
    """The store goes away while a duplicate waits on a fail-open route: the key is held by
    the first request, so running the endpoint unprotected could run it twice. 503 instead."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    runs: list[str] = []
    app = make_app(PostgresStore(pool, command_timeout=2), runs)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            h = {"Idempotency-Key": scope}
            first = asyncio.create_task(c.post("/open", json={"sleep": 1.0}, headers=h))
            await asyncio.sleep(0.1)
            dup = asyncio.create_task(c.post("/open", json={"sleep": 1.0}, headers=h))
            await asyncio.sleep(0.5)  # the duplicate is waiting now
            pool.terminate()
            responses = await asyncio.gather(first, dup)
    finally:
        pool.terminate()
    assert runs == ["x"], "the waiting duplicate ran the endpoint unprotected"
    assert [r.status_code for r in responses] == [503, 503]
    assert "idempotency-status" not in responses[1].headers
