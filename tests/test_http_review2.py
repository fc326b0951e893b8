"""The second HTTP review, on the real Postgres: fail-open never runs a key again whose
outcome this process left unsettled, nor one this process holds (claimed until settled, or
bypassed); a request no route matches is protected under its path; caller labels of
different sources never meet; a failing ``caller=`` is a 400."""

from __future__ import annotations

import asyncio
import hashlib
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
from consumer_idem import http as http_module
from consumer_idem.errors import StoreUnavailable
from consumer_idem.http import IdempotencyMiddleware, idempotent


def client_for(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)


def is_problem(r: httpx.Response, status: int, kind: str) -> bool:
    return (
        r.status_code == status
        and r.headers.get("content-type") == "application/problem+json"
        and r.json()["type"].endswith(kind)
    )


@pytest.fixture
async def refused() -> AsyncIterator[PostgresStore]:
    """A store whose database refuses connections: a proven outage."""
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    yield PostgresStore(pool, command_timeout=2)
    await pool.close()


def switchable(app: Starlette, first: PostgresStore, **options: Any) -> list[PostgresStore]:
    """The middleware's store is ``stores[0]``: a test swaps it to start (or end) an outage."""
    stores = [first]
    app.add_middleware(IdempotencyMiddleware, store=lambda: stores[0], **options)
    return stores


# --- 1: a retry after an unsettled outcome is never bypassed ------------------------------


async def test_fail_open_never_bypasses_a_key_whose_outcome_is_unknown(
    store: PostgresStore, refused: PostgresStore, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    charges: list[str] = []

    async def pay(request: Request) -> JSONResponse:
        charges.append(request.state.idempotency.downstream_key)
        return JSONResponse({"charge": len(charges)}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", idempotent(mode="two_phase", fail_open=True)(pay), methods=["POST"])]
    )
    stores = switchable(app, store, shared_keys=True)

    async def complete(self: Any, *args: Any, **kwargs: Any) -> Any:
        stores[0] = refused  # the database goes away right after the charge
        raise StoreUnavailable("idempotency store complete failed")

    monkeypatch.setattr(http_module.TwoPhaseClaim, "complete", complete)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = await c.post("/pay", json={"amount": 1999}, headers=h)
        retry = await c.post("/pay", json={"amount": 1999}, headers=h)
    assert first.status_code == 503 and "idempotency-status" not in first.headers
    assert is_problem(retry, 503, "outcome-unknown"), retry.text
    assert "idempotency-status" not in retry.headers
    assert len(charges) == 1, "fail-open charged a key whose outcome was unknown again"


async def test_a_bypassed_run_gets_the_protected_downstream_key_and_is_not_bypassed_again(
    refused: PostgresStore, scope: str
) -> None:
    seen: list[tuple[str | None, Any]] = []

    async def pay(request: Request) -> JSONResponse:
        idem = request.state.idempotency  # written like the README: no crash when bypassed
        seen.append((idem.downstream_key, idem.connection))
        return JSONResponse({}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", idempotent(mode="two_phase", fail_open=True)(pay), methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=refused, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = await c.post("/pay", json={}, headers=h)
        retry = await c.post("/pay", json={}, headers=h)
    digest = hashlib.sha256(f"http:anonymous:POST /pay\x00{scope}".encode()).hexdigest()
    assert first.status_code == 201 and first.headers["idempotency-status"] == "bypassed"
    assert seen == [(f"ci-{digest[:40]}", None)]
    assert is_problem(retry, 503, "outcome-unknown"), retry.text


# --- 2: the key is held from its claim until its outcome is committed ---------------------


async def test_fail_open_never_bypasses_a_key_whose_commit_is_in_flight(
    store: PostgresStore, refused: PostgresStore, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({"run": len(runs)}, status_code=201)

    app = Starlette(routes=[Route("/c", idempotent(fail_open=True)(charge), methods=["POST"])])
    stores = switchable(app, store, shared_keys=True)
    committing, go_on = asyncio.Event(), asyncio.Event()
    real_complete = http_module.TransactionalClaim.complete

    async def slow_complete(self: Any, *args: Any, **kwargs: Any) -> Any:
        committing.set()
        await go_on.wait()  # a slow COMMIT
        return await real_complete(self, *args, **kwargs)

    monkeypatch.setattr(http_module.TransactionalClaim, "complete", slow_complete)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = asyncio.create_task(c.post("/c", json={}, headers=h))
        await committing.wait()
        stores[0] = refused  # new connections are refused; the first one's goes on
        second = await c.post("/c", json={}, headers=h)
        go_on.set()
        assert (await first).status_code == 201
    assert is_problem(second, 409, "request-in-progress"), second.text
    assert runs == ["x"]


# --- 3: a protected request meets a bypassed run of its key -------------------------------


async def test_a_protected_request_never_runs_a_key_a_bypassed_run_holds(
    store: PostgresStore, refused: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def slow(request: Request) -> JSONResponse:
        runs.append("x")
        await asyncio.sleep(0.5)
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/p", idempotent(fail_open=True)(slow), methods=["POST"])])
    stores = switchable(app, refused, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = asyncio.create_task(c.post("/p", json={}, headers=h))
        await asyncio.sleep(0.2)
        stores[0] = store  # the database is back
        second = await c.post("/p", json={}, headers=h)
        assert (await first).headers["idempotency-status"] == "bypassed"
    assert is_problem(second, 409, "request-in-progress"), second.text
    assert "retry-after" in second.headers and runs == ["x"]


# --- 4: no route at the outer scope --------------------------------------------------------


class Lower:
    """Normalises the path further in (keeps ``.app``): the outer scope matches no route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "path": scope["path"].lower()}
        await self.app(scope, receive, send)


async def test_a_request_no_route_matches_is_protected_under_its_path(
    store: PostgresStore, scope: str
) -> None:
    seen: list[bool] = []

    async def create(request: Request) -> JSONResponse:
        seen.append(hasattr(request.state, "idempotency"))
        return JSONResponse({"n": len(seen)}, status_code=201)

    inner = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    app = IdempotencyMiddleware(Lower(inner), store=store, shared_keys=True, required=True)
    async with client_for(app) as c:
        missing = await c.post("/Orders", json={})
        first = await c.post("/Orders", json={}, headers={"Idempotency-Key": scope})
        retry = await c.post("/Orders", json={}, headers={"Idempotency-Key": scope})
    assert is_problem(missing, 400, "idempotency-key-missing")
    assert first.status_code == 201 and seen == [True]
    assert retry.headers["idempotent-replayed"] == "true"
    assert await store.get("http:anonymous:POST /Orders", scope) is not None


# --- 5, 6: callers -------------------------------------------------------------------------


async def test_a_caller_named_anonymous_never_shares_the_anonymous_keys(
    store: PostgresStore, scope: str
) -> None:
    async def create(request: Request) -> JSONResponse:
        return JSONResponse({"merchant": request.headers.get("x-merchant-id")}, status_code=201)

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, caller=lambda c: c.headers.get("x-merchant-id")
    )
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        named = await c.post("/orders", json={}, headers={**h, "x-merchant-id": "anonymous"})
        nobody = await c.post("/orders", json={}, headers=h)
    assert named.json() == {"merchant": "anonymous"}
    assert "idempotent-replayed" not in nobody.headers and nobody.json() == {"merchant": None}


def test_caller_labels_of_different_sources_never_meet(store: PostgresStore) -> None:
    class User:
        is_authenticated = True

        def __init__(self, identity: str) -> None:
            self.identity = identity

    def label(value: str | None, user: str | None = None) -> str:
        middleware = IdempotencyMiddleware(
            Starlette(), store=store, caller=lambda c: value, shared_keys=True
        )
        return middleware.caller_of({"type": "http", "user": user and User(user)})

    principals = {label(None, u) for u in ("bob", "u.bob", "x" * 80, "anonymous")}
    callers = {label(v) for v in ("u.bob", "bob", "user:bob", "anonymous", "c.bob", "x" * 80)}
    callers |= {label(v) for v in ("u.u.bob", "%75.bob", "sha256.x", "U.bob")}
    assert label(None) == "anonymous" and label(None, "bob") == "u.bob"
    assert label("acme") == "acme"  # ordinary callers keep their readable label
    assert "anonymous" not in principals | callers
    assert not principals & callers
    assert len(callers) == 10 and len(principals) == 4


async def test_a_caller_function_that_raises_is_a_400_not_a_500(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def create(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/orders", idempotent(required=True)(create), methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-merchant-id"]
    )
    async with client_for(app) as c:
        r = await c.post("/orders", json={}, headers={"Idempotency-Key": scope})
    assert is_problem(r, 400, "caller-unknown"), r.text
    assert "x-merchant-id" not in r.text and runs == []
