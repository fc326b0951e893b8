"""The HTTP guarantees under an adversarial review, on the real Postgres: a truncated upload
never runs, Host-routed tenants never share a record, fail-open never runs an endpoint twice,
caller labels never collide, a wrapped app is protected (or refused), a streamed 5xx or a
stream that dies is never a stored success, hostile JSON is a fingerprint (never a 500), and a
two-phase store failure after the endpoint ran says "outcome unknown"."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Host, Route, Router

from consumer_idem import PostgresStore, Status
from consumer_idem import http as http_module
from consumer_idem.errors import StoreUnavailable
from consumer_idem.http import (
    ConfigurationError,
    IdempotencyMiddleware,
    _caller_label,
    idempotent,
    request_fingerprint,
)
from tests.conftest import free_port

Scope = dict[str, Any]


@pytest.fixture(scope="module")
async def table(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS http_review_rows (k text, what text)")
    return "http_review_rows"


def client_for(app: Any, host: str = "test") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url=f"http://{host}", timeout=30)


def is_problem(r: httpx.Response, status: int, kind: str) -> bool:
    return (
        r.status_code == status
        and r.headers.get("content-type") == "application/problem+json"
        and r.json()["type"].endswith(kind)
    )


async def rows(pool: asyncpg.Pool, table: str, key: str) -> list[str]:
    return [r["what"] for r in await pool.fetch(f"SELECT what FROM {table} WHERE k = $1", key)]


# --- 1: a client that disconnects mid-upload ---------------------------------------------------


def transfer_app(store: PostgresStore, table: str, seen: list[bytes]) -> Starlette:
    async def transfer(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(body)
        idem = request.state.idempotency
        await idem.connection.execute(
            f"INSERT INTO {table} VALUES ($1, $2)", idem.key, body.decode()
        )
        return JSONResponse({"moved": body.decode()})

    app = Starlette(routes=[Route("/transfer", transfer, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    return app


async def test_a_disconnect_mid_upload_runs_nothing_and_stores_nothing(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    """``http.disconnect`` before the last body chunk is no end of body: the endpoint never
    sees the truncated body, no claim is made, and the client's retry runs."""
    seen: list[bytes] = []
    app = transfer_app(store, table, seen)
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
    assert await rows(pg_pool, table, scope) == []
    async with client_for(app) as c:
        retry = await c.post("/transfer", content=full, headers={"Idempotency-Key": scope})
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert seen == [full] and await rows(pg_pool, table, scope) == [full.decode()]


async def test_a_disconnect_mid_upload_over_uvicorn(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    import uvicorn

    seen: list[bytes] = []
    app = transfer_app(store, table, seen)
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
        assert seen == [] and await rows(pg_pool, table, scope) == []
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


# --- 2: Host-routed tenants ------------------------------------------------------------------


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


# --- 3: fail-open ----------------------------------------------------------------------------


@pytest.fixture
async def small_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    assert pool is not None
    yield pool
    pool.terminate()


async def test_fail_open_never_bypasses_a_pool_timeout(
    small_pool: asyncpg.Pool, scope: str
) -> None:
    """The pool is exhausted because the first request holds the key's connection: a timeout
    waiting for a connection proves load, not an outage. Never a second, unprotected run."""
    store = PostgresStore(small_pool, command_timeout=0.3)
    await store.migrate()
    runs: list[str] = []

    async def slow(request: Request) -> JSONResponse:
        runs.append("x")
        await asyncio.sleep(1.0)
        return JSONResponse({"n": len(runs)}, status_code=201)

    app = Starlette(routes=[Route("/p", idempotent(fail_open=True)(slow), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = asyncio.create_task(c.post("/p", json={}, headers=h))
        await asyncio.sleep(0.1)
        dups = await asyncio.gather(*(c.post("/p", json={}, headers=h) for _ in range(5)))
        assert (await first).status_code == 201
    assert runs == ["x"], "fail-open ran the endpoint again while the first held the key"
    for r in dups:
        assert "idempotency-status" not in r.headers
        assert is_problem(r, 503, "store-unavailable") or is_problem(r, 409, "in-progress")


async def test_fail_open_never_bypasses_after_the_store_decided(
    pg_dsn: str, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    """The store answered REPLAY, then the connection died before that decision's COMMIT: the
    store was consulted, the key is completed, so running the endpoint again is a double."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    store = PostgresStore(pool, command_timeout=5)
    runs: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append("charged")
        return JSONResponse({"charge": len(runs)}, status_code=201)

    app = Starlette(routes=[Route("/charge", idempotent(fail_open=True)(charge), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    real_reserve = store.reserve
    try:
        async with client_for(app) as c:
            assert (await c.post("/charge", json={"a": 5}, headers=h)).status_code == 201

            async def reserve(*args: Any, **kwargs: Any) -> Any:
                decision = await real_reserve(*args, **kwargs)
                conn = kwargs.get("conn")
                if conn is not None:  # the backend dies right after it decided
                    await pg_pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
                    await asyncio.sleep(0.1)
                return decision

            store.reserve = reserve  # type: ignore[method-assign]
            retry = await c.post("/charge", json={"a": 5}, headers=h)
    finally:
        pool.terminate()
    assert runs == ["charged"], "fail-open ran a completed key again"
    assert "idempotency-status" not in retry.headers
    assert retry.status_code in (201, 503)


async def test_fail_open_never_runs_one_key_twice_at_once(table: str, scope: str) -> None:
    """The store refuses connections (a proven outage) and the route is fail-open: the first
    request runs unprotected; a duplicate while it runs is a 409, not a second run."""
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    runs: list[str] = []

    async def slow(request: Request) -> JSONResponse:
        runs.append("x")
        await asyncio.sleep(0.5)
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/p", idempotent(fail_open=True)(slow), methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(pool, command_timeout=2), shared_keys=True
    )
    h = {"Idempotency-Key": scope}
    try:
        async with client_for(app) as c:
            first = asyncio.create_task(c.post("/p", json={}, headers=h))
            await asyncio.sleep(0.2)
            dup = await c.post("/p", json={}, headers=h)
            first_response = await first
    finally:
        await pool.close()
    assert first_response.headers["idempotency-status"] == "bypassed"
    assert is_problem(dup, 409, "request-in-progress") and runs == ["x"]


def test_only_a_refused_connection_proves_an_outage() -> None:
    import socket

    def wrapped(cause: BaseException) -> StoreUnavailable:
        error = StoreUnavailable("idempotency store acquire failed")
        error.__cause__ = cause
        return error

    assert http_module.outage_proven(wrapped(ConnectionRefusedError(111, "refused")))
    assert http_module.outage_proven(wrapped(socket.gaierror(-2, "Name or service not known")))
    for not_proof in (
        TimeoutError(),  # a pool exhausted by the key's own holder, or a slow server
        asyncpg.InterfaceError("connection has been released back to the pool"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.TooManyConnectionsError("too many clients"),
        ConnectionResetError(104, "reset"),
    ):
        assert not http_module.outage_proven(wrapped(not_proof)), not_proof


# --- 4: caller labels --------------------------------------------------------------------------


async def test_a_caller_shaped_like_a_hashed_label_never_shares_keys(
    store: PostgresStore, scope: str
) -> None:
    async def me(request: Request) -> JSONResponse:
        return JSONResponse({"account": request.headers["x-account"]}, status_code=201)

    app = Starlette(routes=[Route("/statements", me, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-account"])
    victim = "accounts-payable-department-of-some-very-large-corporation-emea-1"  # > 64
    attacker = "sha256." + hashlib.sha256(victim.encode()).hexdigest()[:40]
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        await c.post("/statements", json={}, headers={**h, "x-account": victim})
        stolen = await c.post("/statements", json={}, headers={**h, "x-account": attacker})
    assert "idempotent-replayed" not in stolen.headers
    assert stolen.json() == {"account": attacker}
    assert _caller_label(attacker) != _caller_label(victim)


def test_verbatim_and_hashed_caller_labels_are_distinct_namespaces() -> None:
    long = "x" * 65
    hashed = _caller_label(long)
    assert hashed.startswith("sha256.")
    for verbatim in (hashed, "sha256.", "sha256.abc", "SHA256.x"):
        label = _caller_label(verbatim)
        assert not label.startswith("sha256."), label
    assert _caller_label("acme") == "acme"  # ordinary callers keep their readable label


# --- 5: a wrapped app --------------------------------------------------------------------------


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


# --- 6: streamed responses -------------------------------------------------------------------


def stream_app(store: PostgresStore, table: str, runs: list[str]) -> Starlette:
    def endpoint(status: int, die: bool) -> Any:
        async def handle(request: Request) -> StreamingResponse:
            idem = request.state.idempotency
            runs.append(request.url.path)
            if idem.connection is not None:
                await idem.connection.execute(
                    f"INSERT INTO {table} VALUES ($1, 'before')", idem.key
                )

            async def chunks() -> AsyncIterator[bytes]:
                yield b"row1\n"
                if idem.connection is not None:  # a write while streaming: same transaction
                    await idem.connection.execute(
                        f"INSERT INTO {table} VALUES ($1, 'during')", idem.key
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
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, table, runs)) as c:
        first = await c.post("/5xx", headers=h)
        assert first.status_code == 503 and first.text == "row1\nrow2\n"
        assert "idempotency-stored" not in first.headers
        record = await store.get("http:anonymous:POST /5xx", scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        assert await rows(pg_pool, table, scope) == []  # rolled back with the record
        retry = await c.post("/5xx", headers=h)
    assert retry.status_code == 503 and "idempotent-replayed" not in retry.headers
    assert runs == ["/5xx", "/5xx"]


async def test_a_stream_that_dies_is_not_a_stored_success(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, table, runs)) as c:
        await c.post("/dies", headers=h)  # cut short: the client sees an error
        record = await store.get("http:anonymous:POST /dies", scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        assert await rows(pg_pool, table, scope) == []
        retry = await c.post("/dies", headers=h)
        assert "idempotent-replayed" not in retry.headers
    assert runs == ["/dies", "/dies"]


async def test_a_complete_stream_commits_its_writes_with_the_record(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, table, runs)) as c:
        first = await c.post("/ok", headers=h)
        again = await c.post("/ok", headers=h)
    assert first.text == "row1\nrow2\n" and first.headers["idempotency-stored"] == "headers-only"
    assert again.headers["idempotent-replayed"] == "true" and again.content == b""
    assert sorted(await rows(pg_pool, table, scope)) == ["before", "during"]
    assert runs == ["/ok"]


@pytest.mark.parametrize("path", ["/tp-5xx", "/tp-dies"])
async def test_a_two_phase_stream_that_fails_is_parked_unknown(
    store: PostgresStore, table: str, scope: str, path: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, table, runs)) as c:
        await c.post(path, headers=h)
        retry = await c.post(path, headers=h)
    record = await store.get(f"http:anonymous:POST {path}", scope)
    assert record is not None and record.status is Status.UNKNOWN and record.response is None
    assert is_problem(retry, 409, "outcome-unknown") and runs == [path]


async def test_a_two_phase_stream_completes_after_its_last_chunk(
    store: PostgresStore, table: str, scope: str
) -> None:
    runs: list[str] = []
    h = {"Idempotency-Key": scope}
    async with client_for(stream_app(store, table, runs)) as c:
        first = await c.post("/tp-ok", headers=h)
        again = await c.post("/tp-ok", headers=h)
    assert first.text == "row1\nrow2\n" and again.headers["idempotent-replayed"] == "true"
    assert runs == ["/tp-ok"]


# --- 7: hostile JSON -------------------------------------------------------------------------


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


# --- 8: two-phase, the store fails after the endpoint ran ------------------------------------


async def test_two_phase_store_loss_after_the_endpoint_ran_says_outcome_unknown(
    pg_dsn: str, pg_pool: asyncpg.Pool, scope: str
) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    store = PostgresStore(pool, command_timeout=5)
    runs: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append("charged")
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(
        routes=[Route("/c", idempotent(mode="two_phase", fail_open=True)(charge), methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    real_complete = store.complete

    async def complete(*args: Any, **kwargs: Any) -> Any:
        conn = kwargs.get("conn")
        await pg_pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
        return await real_complete(*args, **kwargs)

    store.complete = complete  # type: ignore[method-assign]
    h = {"Idempotency-Key": scope}
    try:
        async with client_for(app) as c:
            first = await c.post("/c", json={}, headers=h)
            store.complete = real_complete  # type: ignore[method-assign]
            retry = await c.post("/c", json={}, headers=h)
    finally:
        pool.terminate()
    assert is_problem(first, 503, "outcome-unknown"), first.text
    assert "not processed" not in first.text
    assert retry.status_code == 409 and runs == ["charged"]


async def test_a_stream_the_client_abandons_is_not_a_stored_success(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    """The client goes away mid-stream: Starlette cancels the stream and the endpoint returns
    normally, without the stream's last message. That stream did not end well: rolled back."""
    runs: list[str] = []

    async def export(request: Request) -> StreamingResponse:
        idem = request.state.idempotency
        runs.append("x")
        await idem.connection.execute(f"INSERT INTO {table} VALUES ($1, 'export')", idem.key)

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
    assert await rows(pg_pool, table, scope) == []
    async with client_for(app) as c:
        retry = await c.post("/export", headers={"Idempotency-Key": scope})
    assert "idempotent-replayed" not in retry.headers and runs == ["x", "x"]
