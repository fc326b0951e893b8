"""The two apps the HTTP benchmark compares: one endpoint, with and without the middleware;
and a slow endpoint whose duplicates wait for its result (``wait``).

uvicorn benchmarks.http_apps:with_middleware / :without_middleware
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import load_settings
from consumer_idem.http import IdempotencyMiddleware, idempotent

INSERT = "INSERT INTO bench_orders (item, qty) VALUES ($1, $2)"
state: dict[str, Any] = {}


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    pool = await asyncpg.create_pool(load_settings().pg_dsn, min_size=4, max_size=8)
    assert pool is not None
    state["pool"] = pool
    state["store"] = PostgresStore(pool)
    await state["store"].migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS bench_orders (item text, qty int)")
    yield
    await pool.close()


async def order_plain(request: Request) -> JSONResponse:
    data = await request.json()
    async with state["pool"].acquire() as conn, conn.transaction():
        await conn.execute(INSERT, data["item"], data["qty"])
    return JSONResponse({"ok": True, "item": data["item"]}, status_code=201)


@idempotent(required=True)
async def order_idempotent(request: Request) -> JSONResponse:
    data = await request.json()
    await request.state.idempotency.connection.execute(INSERT, data["item"], data["qty"])
    return JSONResponse({"ok": True, "item": data["item"]}, status_code=201)


@idempotent(required=True, wait=5)
async def order_slow(request: Request) -> JSONResponse:
    data = await request.json()
    await asyncio.sleep(data["sleep"])  # longer than the claim's lock timeout: duplicates wait
    await request.state.idempotency.connection.execute(INSERT, data["item"], data["qty"])
    return JSONResponse({"ok": True, "item": data["item"]}, status_code=201)


without_middleware = Starlette(
    routes=[Route("/orders", order_plain, methods=["POST"])], lifespan=lifespan
)
with_middleware = Starlette(
    routes=[
        Route("/orders", order_idempotent, methods=["POST"]),
        Route("/slow-orders", order_slow, methods=["POST"]),
    ],
    lifespan=lifespan,
)
with_middleware.add_middleware(
    IdempotencyMiddleware, store=lambda: state["store"], shared_keys=True
)
