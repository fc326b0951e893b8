"""The middleware at its failure edges, on the real Postgres: fail-open only before the endpoint
ran, a lock timeout is "in flight", generic 503s, and a commit Postgres rolled back is never a
stored success."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import PostgresStore, Status
from consumer_idem.http import IdempotencyMiddleware, idempotent
from tests._http import client_for, is_problem


@pytest.fixture(scope="module")
async def table(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS http_fault_rows (id text PRIMARY KEY)")
    return "http_fault_rows"


@pytest.fixture
async def private_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    yield pool
    pool.terminate()


# --- finding 4: fail-open never runs the endpoint a second time ------------------------------


async def test_two_phase_fail_open_never_runs_the_endpoint_twice(
    private_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    """Postgres goes away while the endpoint charges: the completion fails. The endpoint ran, so
    the request may not fall back to running it unprotected (that would charge twice)."""
    dropping = PostgresStore(private_pool, command_timeout=2)
    charges: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        charges.append("charged")  # a gateway call (with or without our downstream key)
        private_pool.terminate()  # the store's database connection drops mid-request
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(
        routes=[
            Route(
                "/charges",
                idempotent(mode="two_phase", fail_open=True)(charge),
                methods=["POST"],
            )
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=dropping, shared_keys=True)
    async with client_for(app) as c:
        r = await c.post("/charges", json={}, headers={"Idempotency-Key": scope})
    assert len(charges) == 1, "the endpoint ran twice in one request"
    # the endpoint ran: never "not processed", the outcome is what is unknown
    assert is_problem(r, 503, "outcome-unknown") and "idempotency-status" not in r.headers
    assert "not processed" not in r.text
    record = await store.get("http:anonymous:POST /charges", scope)
    assert record is not None and record.status is Status.IN_PROGRESS  # the lease parks it


@pytest.mark.parametrize("fail_open", [False, True])
async def test_a_lock_timeout_in_reserve_is_in_flight_not_an_outage(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str, fail_open: bool
) -> None:
    """Two retries of a failed_retryable key pass the claim INSERT together; one re-acquires the
    row and holds its lock while its endpoint runs, the other's reserve times out on that lock.
    That is a request in flight (409), never an outage that fail-open may bypass. The other
    retry's row lock is taken here by hand, so the race is deterministic."""
    runs = 0

    async def create(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        if runs == 1:
            return JSONResponse({"error": "upstream"}, status_code=502)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(
        routes=[Route("/things", idempotent(fail_open=fail_open)(create), methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    record_scope = "http:anonymous:POST /things"
    async with client_for(app) as c:
        assert (await c.post("/things", json={}, headers=h)).status_code == 502
        record = await store.get(record_scope, scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        async with pg_pool.acquire() as other:
            await other.execute("BEGIN")
            await other.execute(
                f"SELECT 1 FROM {store.table} WHERE scope = $1 AND key = $2 FOR UPDATE",
                record_scope,
                scope,
            )
            second = await c.post("/things", json={}, headers=h)
            await other.execute("ROLLBACK")
        assert is_problem(second, 409, "request-in-progress") and second.headers["retry-after"]
        assert runs == 1, "the endpoint ran although another retry held the key"
        assert (await c.post("/things", json={}, headers=h)).status_code == 201
    assert runs == 2


# --- finding 5: problems say nothing of the internals ----------------------------------------


async def test_503_detail_is_generic(effects_free_store: Any, scope: str) -> None:
    async def create(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/things", create, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=effects_free_store, shared_keys=True)
    async with client_for(app) as c:
        r = await c.post("/things", json={}, headers={"Idempotency-Key": scope})
    assert is_problem(r, 503, "store-unavailable") and r.headers["retry-after"]
    text = r.text
    for leak in ("Connection", "127.0.0.1", "5999", "Error", "errno"):
        assert leak not in text, text


@pytest.fixture
async def effects_free_store() -> AsyncIterator[PostgresStore]:
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:5999/x", min_size=0)
    assert pool is not None
    yield PostgresStore(pool, command_timeout=2)
    await pool.close()


async def test_a_database_error_at_two_phase_completion_is_a_503_and_the_record_is_safe(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    charges: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        charges.append("charged")

        async def write(conn: asyncpg.Connection) -> None:  # a bug: the row exists already
            await conn.execute(f"INSERT INTO {table} VALUES ($1)", scope)

        request.state.idempotency.add_write(write)
        return JSONResponse({"charged": True}, status_code=201)

    await pg_pool.execute(f"INSERT INTO {table} VALUES ($1)", scope)
    app = Starlette(
        routes=[Route("/charges", idempotent(mode="two_phase")(charge), methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        r = await c.post("/charges", json={}, headers=h)
        assert is_problem(r, 503, "outcome-unknown"), r.text
        assert "UniqueViolation" not in r.text and "http_fault_rows" not in r.text
        again = await c.post("/charges", json={}, headers=h)
    assert is_problem(again, 409, "outcome-unknown")  # parked, reconciled; never charged again
    assert charges == ["charged"]
    record = await store.get("http:anonymous:POST /charges", scope)
    assert record is not None and record.status is Status.UNKNOWN


# --- issue 13, finding 1: a commit Postgres rolled back is not a success ---------------------


async def test_transactional_route_that_swallows_a_database_error_is_not_stored(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    runs: list[str] = []

    async def create(request: Request) -> JSONResponse:
        conn = request.state.idempotency.connection
        runs.append("x")
        await conn.execute(f"INSERT INTO {table} VALUES ($1)", f"{scope}-effect")
        if len(runs) == 1:
            # the bug: a duplicate insert, swallowed without a savepoint
            try:  # noqa: SIM105 (the bug as users write it)
                await conn.execute(f"INSERT INTO {table} VALUES ($1)", scope)
            except asyncpg.UniqueViolationError:
                pass
        return JSONResponse({"ok": True}, status_code=200)

    await pg_pool.execute(f"INSERT INTO {table} VALUES ($1)", scope)
    app = Starlette(routes=[Route("/rows", idempotent(fail_open=True)(create), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        first = await c.post("/rows", json={}, headers=h)
        assert runs == ["x"], "the endpoint ran twice in one request"
        assert first.status_code == 500 and is_problem(first, 500, "request-not-committed")
        record = await store.get("http:anonymous:POST /rows", scope)
        assert record is not None and record.status is Status.FAILED_RETRYABLE
        effect = f"{scope}-effect"
        assert await pg_pool.fetchval(f"SELECT count(*) FROM {table} WHERE id = $1", effect) == 0
        second = await c.post("/rows", json={}, headers=h)
    assert second.status_code == 200 and "idempotent-replayed" not in second.headers
    assert runs == ["x", "x"]
    assert await pg_pool.fetchval(f"SELECT count(*) FROM {table} WHERE id = $1", effect) == 1


async def test_two_phase_local_write_that_swallows_an_error_parks_unknown(
    store: PostgresStore, pg_pool: asyncpg.Pool, table: str, scope: str
) -> None:
    async def charge(request: Request) -> JSONResponse:
        async def write(conn: asyncpg.Connection) -> None:
            try:  # noqa: SIM105 (the bug as users write it)
                await conn.execute(f"INSERT INTO {table} VALUES ($1)", scope)
            except asyncpg.UniqueViolationError:
                pass

        request.state.idempotency.add_write(write)
        return JSONResponse({"charged": True}, status_code=201)

    await pg_pool.execute(f"INSERT INTO {table} VALUES ($1)", scope)
    app = Starlette(
        routes=[Route("/charges", idempotent(mode="two_phase")(charge), methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    async with client_for(app) as c:
        r = await c.post("/charges", json={}, headers={"Idempotency-Key": scope})
    assert r.status_code == 503 and "idempotent-replayed" not in r.headers
    record = await store.get("http:anonymous:POST /charges", scope)
    assert record is not None and record.status is Status.UNKNOWN and record.response is None


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
