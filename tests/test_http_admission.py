"""What the middleware answers before an endpoint runs, and that it says why, on the real
Postgres: a key too long is told its length, a body too large is told the limit, and a request
whose ``caller=`` names nobody is a 401 unless its route takes anonymous callers."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, idempotent
from tests._http import client_for, is_problem


def counting_app(runs: list[str], *, public: bool = False) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        runs.append(request.url.path)
        return JSONResponse({"n": len(runs)}, status_code=201)

    async def create_public(request: Request) -> JSONResponse:
        return await create(request)

    return Starlette(
        routes=[
            Route("/orders", create, methods=["POST"]),
            Route("/public", idempotent(anonymous=True)(create_public), methods=["POST"]),
        ]
    )


async def test_a_key_too_long_is_told_its_length(store: PostgresStore, scope: str) -> None:
    runs: list[str] = []
    app = counting_app(runs)
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    async with client_for(app) as c:
        r = await c.post("/orders", json={}, headers={"Idempotency-Key": scope + "k" * 300})
    assert is_problem(r, 400, "idempotency-key-invalid"), r.text
    detail = r.json()["detail"]
    assert "1 to 255 characters" in detail and str(len(scope) + 300) in detail, detail
    assert runs == []


async def test_a_body_too_large_is_told_the_limit(store: PostgresStore, scope: str) -> None:
    runs: list[str] = []
    app = counting_app(runs)
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True, max_body=64)
    async with client_for(app) as c:
        r = await c.post("/orders", content=b"x" * 65, headers={"Idempotency-Key": scope})
    assert is_problem(r, 413, "body-too-large"), r.text
    assert "64 bytes" in r.json()["detail"]
    assert runs == []


async def test_a_caller_that_names_nobody_is_a_401_unless_the_route_takes_anonymous_callers(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []
    app = counting_app(runs)
    caller: Any = lambda conn: conn.headers.get("x-tenant")  # noqa: E731
    app.add_middleware(IdempotencyMiddleware, store=store, caller=caller)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        nobody = await c.post("/orders", json={}, headers=h)
        named = await c.post("/orders", json={}, headers={**h, "x-tenant": "acme"})
        public = [await c.post("/public", json={}, headers=h) for _ in range(2)]
    assert is_problem(nobody, 401, "caller-missing"), nobody.text
    assert named.status_code == 201 and "idempotent-replayed" not in named.headers
    # the route that takes anonymous callers: they share one key space
    assert [r.status_code for r in public] == [201, 201]
    assert public[1].headers["idempotent-replayed"] == "true"
    assert runs == ["/orders", "/public"]
