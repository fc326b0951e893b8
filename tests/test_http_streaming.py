"""Streamed responses, on the real Postgres: passed through as they come, their last message held
until the outcome is settled; a streamed 5xx, a stream that dies or one the client abandons
is never a stored success, and a complete stream commits its writes with the record."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from consumer_idem import PostgresStore, Status
from consumer_idem.http import (
    IdempotencyMiddleware,
    Scope,
    idempotent,
)
from tests._http import client_for, is_problem, rows


def stream_app(store: PostgresStore, rows_table: str, runs: list[str]) -> Starlette:
    def endpoint(status: int, die: bool) -> Any:
        async def handle(request: Request) -> StreamingResponse:
            idem = request.state.idempotency
            runs.append(request.url.path)
            if idem.connection is not None:
                await idem.connection.execute(
                    f"INSERT INTO {rows_table} VALUES ($1, 'before')", idem.key
                )

            async def chunks() -> AsyncIterator[bytes]:
                yield b"row1\n"
                if idem.connection is not None:  # a write while streaming: same transaction
                    await idem.connection.execute(
                        f"INSERT INTO {rows_table} VALUES ($1, 'during')", idem.key
                    )
                if die:
                    raise RuntimeError("generator died")
                yield b"row2\n"

            return StreamingResponse(chunks(), status_code=status)

        return handle

    app = Starlette(
        routes=[
            Route("/ok", endpoint(200, False), methods=["POST"]),
            Route("/5xx", endpoint(503, False), methods=["POST"]),
            Route("/dies", endpoint(200, True), methods=["POST"]),
            Route("/tp-ok", idempotent(mode="two_phase")(endpoint(200, False)), methods=["POST"]),
            Route("/tp-5xx", idempotent(mode="two_phase")(endpoint(503, False)), methods=["POST"]),
            Route("/tp-dies", idempotent(mode="two_phase")(endpoint(200, True)), methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    return app


async def test_a_streamed_5xx_is_not_stored_and_the_retry_runs(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, rows_table, runs)) as c:
        first = await c.post("/5xx", headers=h)
        assert first.status_code == 503 and first.text == "row1\nrow2\n"
        assert "idempotency-stored" not in first.headers
        record = await store.get("http:anonymous:POST /5xx", scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        assert await rows(pg_pool, rows_table, scope) == []  # rolled back with the record
        retry = await c.post("/5xx", headers=h)
    assert retry.status_code == 503 and "idempotent-replayed" not in retry.headers
    assert runs == ["/5xx", "/5xx"]


async def test_a_stream_that_dies_is_not_a_stored_success(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, rows_table, runs)) as c:
        await c.post("/dies", headers=h)  # cut short: the client sees an error
        record = await store.get("http:anonymous:POST /dies", scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        assert await rows(pg_pool, rows_table, scope) == []
        retry = await c.post("/dies", headers=h)
        assert "idempotent-replayed" not in retry.headers
    assert runs == ["/dies", "/dies"]


async def test_a_complete_stream_commits_its_writes_with_the_record(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, rows_table, runs)) as c:
        first = await c.post("/ok", headers=h)
        again = await c.post("/ok", headers=h)
    assert first.text == "row1\nrow2\n" and first.headers["idempotency-stored"] == "headers-only"
    assert again.headers["idempotent-replayed"] == "true" and again.content == b""
    assert sorted(await rows(pg_pool, rows_table, scope)) == ["before", "during"]
    assert runs == ["/ok"]


@pytest.mark.parametrize("path", ["/tp-5xx", "/tp-dies"])
async def test_a_two_phase_stream_that_fails_is_parked_unknown(
    store: PostgresStore, rows_table: str, scope: str, path: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, rows_table, runs)) as c:
        await c.post(path, headers=h)
        retry = await c.post(path, headers=h)
    record = await store.get(f"http:anonymous:POST {path}", scope)
    assert record is not None and record.status is Status.UNKNOWN and record.response is None
    assert is_problem(retry, 409, "outcome-unknown") and runs == [path]


async def test_a_two_phase_stream_completes_after_its_last_chunk(
    store: PostgresStore, rows_table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, rows_table, runs)) as c:
        first = await c.post("/tp-ok", headers=h)
        again = await c.post("/tp-ok", headers=h)
    assert first.text == "row1\nrow2\n" and again.headers["idempotent-replayed"] == "true"
    assert runs == ["/tp-ok"]


async def test_a_stream_the_client_abandons_is_not_a_stored_success(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows_table: str, scope: str
) -> None:
    """The client goes away mid-stream: Starlette cancels the stream and the endpoint returns
    normally, without the stream's last message. That stream did not end well: rolled back."""
    runs: list[str] = []

    async def export(request: Request) -> StreamingResponse:
        idem = request.state.idempotency
        runs.append("x")
        await idem.connection.execute(f"INSERT INTO {rows_table} VALUES ($1, 'export')", idem.key)

        async def chunks() -> AsyncIterator[bytes]:
            yield b"row1\n"
            if len(runs) == 1:
                await asyncio.sleep(5)  # cancelled when the client leaves
            yield b"row2\n"

        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/export", export, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    first_chunk = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    asgi: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/export",
        "raw_path": b"/export",
        "root_path": "",
        "query_string": b"",
        "server": ("test", 80),
        "client": ("c", 1),
        "headers": [(b"host", b"test"), (b"idempotency-key", scope.encode())],
    }
    await asyncio.wait_for(app(asgi, receive, send), 3)
    assert not any(m.get("more_body") is False for m in sent if m["type"] == "http.response.body")
    record = await store.get("http:anonymous:POST /export", scope)
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    assert await rows(pg_pool, rows_table, scope) == []
    async with client_for(app) as c:
        retry = await c.post("/export", headers={"Idempotency-Key": scope})
    assert "idempotent-replayed" not in retry.headers and runs == ["x", "x"]
