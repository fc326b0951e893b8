"""An answer is recorded only once the endpoint began executing: what the framework answers
before (a validation 422, a 404 or 405 of the router, a dependency that refuses) is passed
through, and the same key runs when the corrected request comes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, idempotent
from tests._cli import cli


class Order(BaseModel):
    amount: int


@pytest.fixture
async def http(store: PostgresStore) -> AsyncIterator[Any]:
    """``await http(app, ...)``: an httpx client on ``app`` with the middleware added."""
    clients: list[httpx.AsyncClient] = []

    async def make(app: Any, **options: Any) -> httpx.AsyncClient:
        app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True, **options)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://test")
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def records(store: PostgresStore, key: str) -> list[str]:
    """The statuses of the records of ``key``, whatever their scope."""
    rows = await store.pool.fetch(f"SELECT status FROM {store.table} WHERE key = $1", key)
    return [row["status"] for row in rows]


def orders_app(runs: list[int], *, sync: bool = False) -> FastAPI:
    app = FastAPI()
    if sync:

        @app.post("/orders", status_code=201)
        def create_sync(order: Order) -> dict[str, int]:
            runs.append(order.amount)
            return {"amount": order.amount}

    else:

        @app.post("/orders", status_code=201)
        async def create(order: Order) -> dict[str, int]:
            runs.append(order.amount)
            return {"amount": order.amount}

    return app


@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_validation_failure_is_not_recorded_and_the_corrected_retry_runs(
    http: Any, store: PostgresStore, scope: str, pg_dsn: str, mode: str, sync: bool
) -> None:
    runs: list[int] = []
    client = await http(orders_app(runs, sync=sync), mode=mode)
    h = {"Idempotency-Key": scope}
    invalid = await client.post("/orders", json={"amount": "lots"}, headers=h)
    assert invalid.status_code == 422 and runs == []
    assert await records(store, scope) == []
    record_scope = "http:anonymous:POST /orders"
    code, _, err = await cli("inspect", record_scope, scope, dsn=pg_dsn)
    assert code == 2 and ("no record" in err or "unknown scope" in err)
    corrected = await client.post("/orders", json={"amount": 5}, headers=h)
    assert corrected.status_code == 201 and corrected.json() == {"amount": 5}
    again = await client.post("/orders", json={"amount": 5}, headers=h)
    assert again.status_code == 201 and again.headers.get("idempotent-replayed") == "true"
    assert runs == [5]
    code, out, _ = await cli("inspect", record_scope, scope, "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out)["status"] == "completed"


async def test_a_404_and_a_405_of_the_router_are_not_recorded(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[int] = []
    app = orders_app(runs)

    @app.put("/orders/{order_id}")
    async def replace(order_id: int) -> dict[str, int]:
        runs.append(order_id)
        return {"order": order_id}

    client = await http(app)
    missing = await client.post("/nowhere", json={}, headers={"Idempotency-Key": scope})
    assert missing.status_code == 404
    wrong = await client.post("/orders/1", json={}, headers={"Idempotency-Key": scope + "m"})
    assert wrong.status_code == 405
    assert await records(store, scope) == [] and await records(store, scope + "m") == []
    assert runs == []


async def test_a_dependency_that_refuses_is_not_recorded(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[int] = []

    async def signed_in(x_user: str | None = Header(default=None)) -> str:
        if x_user is None:
            raise HTTPException(403, "sign in first")
        return x_user

    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order, user: str = Depends(signed_in)) -> dict[str, Any]:
        runs.append(order.amount)
        return {"amount": order.amount, "user": user}

    client = await http(app)
    h = {"Idempotency-Key": scope}
    refused = await client.post("/orders", json={"amount": 5}, headers=h)
    assert refused.status_code == 403 and await records(store, scope) == []
    signed = await client.post("/orders", json={"amount": 5}, headers={**h, "X-User": "ann"})
    assert signed.status_code == 201 and runs == [5]
    assert await records(store, scope) == ["completed"]


@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
async def test_an_endpoint_that_ran_and_answered_4xx_is_recorded_and_replayed(
    http: Any, store: PostgresStore, scope: str, mode: str
) -> None:
    runs: list[int] = []
    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order) -> dict[str, int]:
        runs.append(order.amount)
        raise HTTPException(409, "out of stock")

    client = await http(app, mode=mode)
    h = {"Idempotency-Key": scope}
    first = await client.post("/orders", json={"amount": 5}, headers=h)
    assert first.status_code == 409
    again = await client.post("/orders", json={"amount": 5}, headers=h)
    assert again.status_code == 409 and again.headers.get("idempotent-replayed") == "true"
    assert runs == [5] and await records(store, scope) == ["completed"]


async def test_a_starlette_route_records_its_own_4xx_but_not_the_routers_405(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def refuse(request: Request) -> JSONResponse:
        runs.append(request.method)
        return JSONResponse({"error": "no"}, status_code=400)

    app = Starlette(routes=[Route("/a", refuse, methods=["POST"]), Route("/b", refuse)])
    client = await http(app)
    wrong = await client.post("/b", json={}, headers={"Idempotency-Key": scope + "b"})
    assert wrong.status_code == 405 and await records(store, scope + "b") == []
    ran = await client.post("/a", json={}, headers={"Idempotency-Key": scope})
    again = await client.post("/a", json={}, headers={"Idempotency-Key": scope})
    assert ran.status_code == again.status_code == 400 and runs == ["POST"]
    assert await records(store, scope) == ["completed"]


async def test_a_wrong_content_type_is_not_recorded(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[int] = []
    client = await http(orders_app(runs))
    h = {"Idempotency-Key": scope}
    plain = await client.post("/orders", content=b'{"amount": 5}', headers=h)
    assert plain.status_code in (415, 422) and await records(store, scope) == []
    typed = await client.post("/orders", json={"amount": 5}, headers=h)
    assert typed.status_code == 201 and runs == [5]


async def test_routes_it_cannot_watch_still_record_every_answer(
    http: Any, store: PostgresStore, scope: str
) -> None:
    """An included router or a mounted app: the middleware cannot tell whether their
    endpoint began, so it records what they answer, as it always did."""
    runs: list[int] = []
    included = APIRouter()

    @included.post("/included")
    async def refuse(order: Order) -> None:
        runs.append(order.amount)
        raise HTTPException(409, "out of stock")

    app = FastAPI()
    app.include_router(included, prefix="/r")
    app.mount("/sub", orders_app(runs))
    client = await http(app)
    for path, status in (("/r/included", 409), ("/sub/orders", 201)):
        h = {"Idempotency-Key": f"{scope}{path}"}
        first = await client.post(path, json={"amount": 5}, headers=h)
        again = await client.post(path, json={"amount": 5}, headers=h)
        assert first.status_code == again.status_code == status
        assert again.headers.get("idempotent-replayed") == "true"
    assert runs == [5, 5]


@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
async def test_a_duplicate_waiting_on_a_refused_request_runs_itself(
    http: Any, store: PostgresStore, scope: str, mode: str
) -> None:
    """The first request is refused by a dependency while a duplicate waits for its key:
    the key is let go, and the duplicate runs as the first request."""
    runs: list[int] = []
    entered, release = asyncio.Event(), asyncio.Event()
    calls: list[int] = []

    async def gate() -> None:
        calls.append(1)
        if len(calls) == 1:  # the first request waits here, then is refused
            entered.set()
            await release.wait()
            raise HTTPException(403, "not yet")

    app = FastAPI()

    @app.post("/orders", status_code=201, dependencies=[Depends(gate)])
    @idempotent(wait=10)
    async def create(order: Order) -> dict[str, int]:
        runs.append(order.amount)
        return {"amount": order.amount}

    client = await http(app, mode=mode)
    h = {"Idempotency-Key": scope}
    first = asyncio.create_task(client.post("/orders", json={"amount": 5}, headers=h))
    await asyncio.wait_for(entered.wait(), 5)
    duplicate = asyncio.create_task(client.post("/orders", json={"amount": 5}, headers=h))
    await asyncio.sleep(0.3)  # the duplicate meets the key in flight and waits
    assert not duplicate.done()
    release.set()
    refused, ran = await asyncio.wait_for(asyncio.gather(first, duplicate), 10)
    assert refused.status_code == 403 and ran.status_code == 201
    assert runs == [5] and await records(store, scope) == ["completed"]
