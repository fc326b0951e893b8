"""Which route a request goes to, on the real Postgres: Host-routed tenants never share a record,
a wrapped app is protected through its middleware (or the middleware refuses to start), and a
request no route matches is protected under its path."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Route, Router

from consumer_idem import PostgresStore, Status
from consumer_idem.http import (
    ConfigurationError,
    IdempotencyMiddleware,
    Scope,
    idempotent,
    request_fingerprint,
)
from tests._http import client_for, is_problem


async def test_host_routed_tenants_never_share_a_record(store: PostgresStore, scope: str) -> None:
    runs: list[str] = []

    async def create_order(request: Request) -> JSONResponse:
        tenant = request.path_params["tenant"]
        runs.append(tenant)
        return JSONResponse({"tenant": tenant, "order": len(runs)}, status_code=201)

    tenant_routes = Router(routes=[Route("/orders", create_order, methods=["POST"])])
    app = Starlette(routes=[Host("{tenant}.shop.example", app=tenant_routes)])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app, "a.shop.example") as a, client_for(app, "b.shop.example") as b:
        first = await a.post("/orders", json={"sku": 1}, headers=h)
        other = await b.post("/orders", json={"sku": 1}, headers=h)
        again = await a.post("/orders", json={"sku": 1}, headers=h)
    assert first.json() == {"tenant": "a", "order": 1}
    assert other.status_code == 201 and "idempotent-replayed" not in other.headers
    assert other.json() == {"tenant": "b", "order": 2}, "tenant b got tenant a's response"
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert runs == ["a", "b"]
    template = "POST //{tenant}.shop.example/orders"
    for tenant in ("a", "b"):
        record = await store.get(f"http:anonymous|{tenant}.shop.example:{template}", scope)
        assert record is not None and record.status is Status.COMPLETED


def test_the_fingerprint_covers_the_host_when_routing_depends_on_it() -> None:
    body = b'{"sku": 1}'
    a = request_fingerprint("POST", "/orders", b"", body, host="a.shop.example")
    b = request_fingerprint("POST", "/orders", b"", body, host="b.shop.example")
    assert a != b and a != request_fingerprint("POST", "/orders", b"", body)


async def test_a_wrapped_app_is_protected_through_its_middleware(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({"charge": len(runs)})

    inner = Starlette(
        routes=[Route("/charge", idempotent(required=True)(charge), methods=["POST"])]
    )
    app = IdempotencyMiddleware(GZipMiddleware(inner), store=store, shared_keys=True)
    async with client_for(app) as c:
        missing = await c.post("/charge", json={})
        first = await c.post("/charge", json={}, headers={"Idempotency-Key": scope})
        again = await c.post("/charge", json={}, headers={"Idempotency-Key": scope})
    assert is_problem(missing, 400, "idempotency-key-missing")
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert runs == ["x"]


def test_an_app_without_reachable_routes_refuses_to_start(store: PostgresStore) -> None:
    async def bare(scope: Scope, receive: Any, send: Any) -> None:  # pragma: no cover
        raise AssertionError

    refused = IdempotencyMiddleware(bare, store=store, shared_keys=True)
    assert isinstance(refused.refusal, ConfigurationError)
    assert "route" in str(refused.refusal)
    inner = Starlette(routes=[])
    # an explicit router works for a stack the middleware cannot see through
    assert IdempotencyMiddleware(bare, store=store, shared_keys=True, router=inner).refusal is None


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
