"""Fail-open, on the real Postgres: a route may run unprotected only when the store is proven
unreachable before the endpoint ran and nobody can hold the key; never a pool timeout, never
after the store decided, never one key twice at once, never a key whose outcome this process
left unsettled or holds."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.claim import TransactionalClaim, TwoPhaseClaim
from consumer_idem.errors import StoreUnavailable
from consumer_idem.http import (
    IdempotencyMiddleware,
    idempotent,
    outage_proven,
)
from tests._http import client_for, is_problem


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
    pg_dsn: str, pg_pool: asyncpg.Pool, rows_table: str, scope: str
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


async def test_fail_open_never_runs_one_key_twice_at_once(rows_table: str, scope: str) -> None:
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

    def wrapped(cause: BaseException) -> StoreUnavailable:
        error = StoreUnavailable("idempotency store acquire failed")
        error.__cause__ = cause
        return error

    assert outage_proven(wrapped(ConnectionRefusedError(111, "refused")))
    assert outage_proven(wrapped(socket.gaierror(-2, "Name or service not known")))
    for not_proof in (
        TimeoutError(),  # a pool exhausted by the key's own holder, or a slow server
        asyncpg.InterfaceError("connection has been released back to the pool"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.TooManyConnectionsError("too many clients"),
        ConnectionResetError(104, "reset"),
    ):
        assert not outage_proven(wrapped(not_proof)), not_proof


def switchable(app: Starlette, first: PostgresStore, **options: Any) -> list[PostgresStore]:
    """The middleware's store is ``stores[0]``: a test swaps it to start (or end) an outage."""
    stores = [first]
    app.add_middleware(IdempotencyMiddleware, store=lambda: stores[0], **options)
    return stores


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

    monkeypatch.setattr(TwoPhaseClaim, "complete", complete)
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
    real_complete = TransactionalClaim.complete

    async def slow_complete(self: Any, *args: Any, **kwargs: Any) -> Any:
        committing.set()
        await go_on.wait()  # a slow COMMIT
        return await real_complete(self, *args, **kwargs)

    monkeypatch.setattr(TransactionalClaim, "complete", slow_complete)
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
