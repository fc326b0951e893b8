"""What one record of the middleware covers: the concrete request (path parameters, query,
body), routes resolved the way Starlette routes them (mounts, sub-apps, included routers), the
Idempotency-Key header read strictly, and a plain 500 never stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from consumer_idem import PostgresStore, Status
from consumer_idem.http import IdempotencyMiddleware, idempotent, not_idempotent, parse_key_header


@pytest.fixture
async def http(store: PostgresStore) -> AsyncIterator[Any]:
    """``await http(app)``: an httpx client on ``app`` with the middleware added."""
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


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


# --- finding 1: the concrete request, not the route template --------------------------------


async def test_path_parameters_are_part_of_the_request(http: Any, scope: str) -> None:
    runs: list[str] = []

    async def update(request: Request) -> JSONResponse:
        runs.append(request.path_params["order_id"])
        return JSONResponse({"order": request.path_params["order_id"]})

    client = await http(Starlette(routes=[Route("/orders/{order_id}", update, methods=["PATCH"])]))
    h = {"Idempotency-Key": scope}
    first = await client.patch("/orders/1", json={"status": "paid"}, headers=h)
    assert first.status_code == 200 and first.json() == {"order": "1"}
    other = await client.patch("/orders/2", json={"status": "paid"}, headers=h)
    # never order 1's stored answer for order 2
    assert other.status_code == 422 and not replayed(other)
    assert other.json()["type"].endswith("idempotency-key-reused")
    assert runs == ["1"]
    again = await client.patch("/orders/1", json={"status": "paid"}, headers=h)
    assert again.status_code == 200 and replayed(again) and runs == ["1"]


async def test_the_query_string_is_part_of_the_request(http: Any, scope: str) -> None:
    runs: list[str] = []

    async def transfer(request: Request) -> JSONResponse:
        runs.append(str(request.query_params))
        return JSONResponse({"moved": int(request.query_params["amount"])})

    client = await http(Starlette(routes=[Route("/transfer", transfer, methods=["POST"])]))
    h = {"Idempotency-Key": scope}
    first = await client.post("/transfer?amount=100&to=b", headers=h)
    assert first.json() == {"moved": 100}
    bigger = await client.post("/transfer?amount=5000&to=b", headers=h)
    assert bigger.status_code == 422 and not replayed(bigger)
    # the same parameters in another order are the same request: replayed
    same = await client.post("/transfer?to=b&amount=100", headers=h)
    assert same.status_code == 200 and replayed(same) and same.json() == {"moved": 100}
    assert len(runs) == 1


# --- finding 2: routes resolved the way Starlette routes them --------------------------------


async def test_routes_under_a_mount_are_told_apart(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def a(request: Request) -> JSONResponse:
        runs.append("a")
        return JSONResponse({"route": "a"}, status_code=201)

    async def b(request: Request) -> JSONResponse:
        runs.append("b")
        return JSONResponse({"route": "b"}, status_code=201)

    @not_idempotent
    async def plain(request: Request) -> JSONResponse:
        runs.append("plain")
        return JSONResponse({"route": "plain"})

    app = Starlette(
        routes=[
            Mount(
                "/api",
                routes=[
                    Route("/a", a, methods=["POST"]),
                    Route("/b", b, methods=["POST"]),
                    Route("/plain", plain, methods=["POST"]),
                    Mount(
                        "/deep",
                        routes=[Route("/c/{n}", idempotent(required=True)(a), methods=["POST"])],
                    ),
                ],
            )
        ]
    )
    client = await http(app)
    h = {"Idempotency-Key": scope}
    ra = await client.post("/api/a", json={}, headers=h)
    rb = await client.post("/api/b", json={}, headers=h)
    assert ra.json() == {"route": "a"} and rb.json() == {"route": "b"} and not replayed(rb)
    for _ in range(2):  # opted out under the mount: runs every time
        assert not replayed(await client.post("/api/plain", json={}, headers=h))
    assert runs.count("plain") == 2
    # nested mounts: the inner route's options apply, and its template is the full path
    missing = await client.post("/api/deep/c/1", json={})
    assert missing.status_code == 400
    await client.post("/api/deep/c/1", json={}, headers=h)
    assert (await client.post("/api/deep/c/2", json={}, headers=h)).status_code == 422
    record = await store.get("http:anonymous:POST /api/deep/c/{n}", scope)
    assert record is not None and record.status is Status.COMPLETED


async def test_fastapi_include_router_and_mounted_sub_app(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []
    router = APIRouter(prefix="/v1")

    @router.post("/orders/{order_id}", status_code=201)
    @idempotent(required=True)
    async def create(order_id: str) -> dict[str, str]:
        runs.append(f"v1:{order_id}")
        return {"order": order_id}

    sub = FastAPI()

    @sub.post("/x")
    async def x() -> dict[str, str]:
        runs.append("sub:x")
        return {"route": "x"}

    @sub.post("/y")
    async def y() -> dict[str, str]:
        runs.append("sub:y")
        return {"route": "y"}

    @sub.post("/off")
    @not_idempotent
    async def off() -> dict[str, str]:
        runs.append("sub:off")
        return {"route": "off"}

    app = FastAPI()
    app.include_router(router)
    app.mount("/sub", sub)
    client = await http(app)
    h = {"Idempotency-Key": scope}
    assert (await client.post("/v1/orders/7", headers={})).status_code == 400  # required
    assert (await client.post("/v1/orders/7", headers=h)).json() == {"order": "7"}
    assert (await client.post("/v1/orders/8", headers=h)).status_code == 422
    assert replayed(await client.post("/v1/orders/7", headers=h))
    assert (await client.post("/sub/x", headers=h)).json() == {"route": "x"}
    ry = await client.post("/sub/y", headers=h)
    assert ry.json() == {"route": "y"} and not replayed(ry)
    await client.post("/sub/off", headers=h)
    assert not replayed(await client.post("/sub/off", headers=h))
    assert runs == ["v1:7", "sub:x", "sub:y", "sub:off", "sub:off"]
    for template in ("/v1/orders/{order_id}", "/sub/x", "/sub/y"):  # full templates
        assert await store.get(f"http:anonymous:POST {template}", scope) is not None


# --- finding 7: the header, read strictly ----------------------------------------------------


def test_structured_field_string_with_parameters() -> None:
    assert parse_key_header('"k-1";v=1') == "k-1"
    assert parse_key_header('"k-1"; a=?1;b="x;y";c=1.5;d=tok') == "k-1"
    for bad in ('"k";', '"k";V=1', '"k" junk', '"k", "j"', "tok;v=1"):
        with pytest.raises(ValueError):
            parse_key_header(bad)


async def test_two_key_header_lines_are_refused(http: Any, scope: str) -> None:
    runs: list[str] = []

    async def create(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({}, status_code=201)

    client = await http(Starlette(routes=[Route("/things", create, methods=["POST"])]))
    r = await client.post(
        "/things",
        json={},
        headers=[("Idempotency-Key", f"{scope}-a"), ("Idempotency-Key", f"{scope}-b")],
    )
    assert r.status_code == 400 and r.json()["type"].endswith("idempotency-key-invalid")
    assert runs == []


# --- finding 9: a plain 500 is not a result ----------------------------------------------------


async def test_a_plain_500_is_not_stored_and_the_retry_runs_again(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def flaky(request: Request) -> JSONResponse:
        runs.append("x")
        if len(runs) == 1:
            return JSONResponse({"error": "internal"}, status_code=500)
        return JSONResponse({"ok": True}, status_code=201)

    client = await http(Starlette(routes=[Route("/flaky", flaky, methods=["POST"])]))
    h = {"Idempotency-Key": scope}
    first = await client.post("/flaky", json={}, headers=h)
    assert first.status_code == 500
    record = await store.get("http:anonymous:POST /flaky", scope)
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    second = await client.post("/flaky", json={}, headers=h)
    assert second.status_code == 201 and not replayed(second) and len(runs) == 2


async def test_a_plain_500_of_a_two_phase_route_is_parked_not_stored(
    http: Any, store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    @idempotent(mode="two_phase")
    async def charge(request: Request) -> JSONResponse:
        runs.append("x")  # the gateway may have charged before the 500
        return JSONResponse({"error": "internal"}, status_code=500)

    client = await http(Starlette(routes=[Route("/charges", charge, methods=["POST"])]))
    h = {"Idempotency-Key": scope}
    assert (await client.post("/charges", json={}, headers=h)).status_code == 500
    record = await store.get("http:anonymous:POST /charges", scope)
    assert record is not None and record.status is Status.UNKNOWN and record.response is None
    again = await client.post("/charges", json={}, headers=h)
    assert again.status_code == 409 and again.json()["type"].endswith("outcome-unknown")
    assert runs == ["x"]
