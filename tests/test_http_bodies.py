"""Reading a request body, on the real Postgres: nothing runs on a part of a body (a client that
disconnects mid-upload gets no claim, no run, no record), and any body, however nested, is a
fingerprint, never a 500."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.http import (
    IdempotencyMiddleware,
    Scope,
)
from tests._http import client_for, is_problem, rows
from tests.conftest import free_port


def transfer_app(store: PostgresStore, rows_table: str, seen: list[bytes]) -> Starlette:
    async def transfer(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(body)
        idem = request.state.idempotency
        await idem.connection.execute(
            f"INSERT INTO {rows_table} VALUES ($1, $2)", idem.key, body.decode()
        )
        return JSONResponse({"moved": body.decode()})

    app = Starlette(routes=[Route("/transfer", transfer, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    return app


async def test_a_disconnect_mid_upload_runs_nothing_and_stores_nothing(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    """``http.disconnect`` before the last body chunk is no end of body: the endpoint never
    sees the truncated body, no claim is made, and the client's retry runs."""
    seen: list[bytes] = []
    app = transfer_app(store, rows_table, seen)
    full = b"to=bobby&amount=1000"
    messages = [
        {"type": "http.request", "body": full[:15], "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asgi: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/transfer",
        "raw_path": b"/transfer",
        "root_path": "",
        "query_string": b"",
        "server": ("test", 80),
        "client": ("c", 1),
        "headers": [
            (b"host", b"test"),
            (b"idempotency-key", scope.encode()),
            (b"content-length", str(len(full)).encode()),
        ],
    }
    await app(asgi, receive, send)
    assert seen == [], "the endpoint ran on a truncated body"
    assert await store.get("http:anonymous:POST /transfer", scope) is None
    assert await rows(pg_pool, rows_table, scope) == []
    async with client_for(app) as c:
        retry = await c.post("/transfer", content=full, headers={"Idempotency-Key": scope})
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert seen == [full] and await rows(pg_pool, rows_table, scope) == [full.decode()]


async def test_a_disconnect_mid_upload_over_uvicorn(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    import uvicorn

    seen: list[bytes] = []
    app = transfer_app(store, rows_table, seen)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event)
            await asyncio.sleep(0.02)
        full = b"to=bob&amount=1000"
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /transfer HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\n"
            b"Content-Length: %d\r\n\r\n" % (scope.encode(), len(full))
        )
        writer.write(full[:16])  # ... and the connection drops mid-upload
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.sleep(0.5)
        assert seen == [] and await rows(pg_pool, rows_table, scope) == []
        assert await store.get("http:anonymous:POST /transfer", scope) is None
        async with httpx.AsyncClient() as c:
            retry = await c.post(
                f"http://127.0.0.1:{port}/transfer",
                content=full,
                headers={"Idempotency-Key": scope},
            )
        assert retry.status_code == 200 and seen == [full]
    finally:
        server.should_exit = True
        await task


async def test_deeply_nested_json_is_fingerprinted_not_a_500(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def ok(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/ok", ok, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    deep = b"[" * 100_000 + b"]" * 100_000
    async with client_for(app) as c:
        for i, body in enumerate((deep, b"[" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000)):
            key = f"{scope}-{i}"
            first = await c.post("/ok", content=body, headers={"Idempotency-Key": key})
            again = await c.post("/ok", content=body, headers={"Idempotency-Key": key})
            assert first.status_code == 200, first.text
            assert again.headers["idempotent-replayed"] == "true"
        other = await c.post("/ok", content=deep + b" ", headers={"Idempotency-Key": f"{scope}-0"})
    assert is_problem(other, 422, "idempotency-key-reused")
    assert runs == ["x"] * 3
