"""SQLAlchemy sessions bound to the idempotency transaction, on the real Postgres, with the store
on the application's engine (``EnginePool``) and on an asyncpg pool: ORM writes commit with the
record or not at all; ``session.commit()`` is a flush; ``session.rollback()`` rolls back the
whole unit; results as models; the HTTP dependency and the Starlette helper."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import JSON, BigInteger, Identity, Integer, Text, event, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from consumer_idem import (
    Action,
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    Status,
    UnstorableResult,
    header,
    idempotent_consumer,
    run_transactional,
)
from consumer_idem.commit import savepoint
from consumer_idem.http import IdempotencyMiddleware, NotInTransaction, idempotent
from consumer_idem.sqlalchemy import (
    EnginePool,
    SessionRolledBack,
    bound_session,
    connection_of,
    engine_store,
    request_session,
    with_session,
)
from consumer_idem.sqlalchemy.fastapi import IdempotentSession, IdempotentTransaction
from tests.conftest import unique

FP = "v1:jcs:sa"


class Base(DeclarativeBase):
    pass


class Item(Base):
    __tablename__ = "sa_test_items"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    scope: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text, unique=True)
    qty: Mapped[int] = mapped_column(Integer, default=1)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class ItemOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    qty: int


@dataclasses.dataclass
class Receipt:
    item: ItemOut
    note: str


@pytest.fixture(scope="session")
async def engine(pg_dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(make_url(pg_dsn).set(drivername="postgresql+asyncpg"))
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.execute(text("CREATE TABLE IF NOT EXISTS sa_test_raw (scope text, note text)"))
    yield engine
    await engine.dispose()


@pytest.fixture(params=["engine", "asyncpg_pool"])
async def sa_store(
    request: pytest.FixtureRequest, engine: AsyncEngine, store: PostgresStore
) -> PostgresStore:
    """The store on the application's engine (one pool), or on the asyncpg pool."""
    if request.param == "engine":
        return engine_store(engine)
    return store


async def names(pool: asyncpg.Pool, scope: str) -> list[str]:
    rows = await pool.fetch("SELECT name FROM sa_test_items WHERE scope = $1 ORDER BY id", scope)
    return [r["name"] for r in rows]


async def raw_notes(pool: asyncpg.Pool, scope: str) -> list[str]:
    rows = await pool.fetch("SELECT note FROM sa_test_raw WHERE scope = $1", scope)
    return [r["note"] for r in rows]


# --- the unit: commit with the record, or nothing -----------------------------------------------


async def test_orm_writes_commit_with_the_record_and_a_replay_runs_nothing(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    calls = 0

    async def handler(session: AsyncSession) -> ItemOut:
        nonlocal calls
        calls += 1
        item = Item(scope=scope, name=f"{scope}-a", qty=2, data={"k": [1, 2]})
        session.add(item)
        await session.flush()
        return ItemOut.model_validate(item)

    first = await run_transactional(sa_store, scope, "k1", FP, with_session(handler))
    assert first.kind is OutcomeKind.EXECUTED
    again = await run_transactional(sa_store, scope, "k1", FP, with_session(handler))
    assert again.kind is OutcomeKind.REPLAYED and calls == 1
    assert await names(pg_pool, scope) == [f"{scope}-a"]
    item_id = await pg_pool.fetchval("SELECT id FROM sa_test_items WHERE scope = $1", scope)
    # stored and replayed as JSON: the model's JSON form
    assert again.result == {"id": item_id, "name": f"{scope}-a", "qty": 2}
    record = await sa_store.get(scope, "k1")
    assert record is not None and record.status is Status.COMPLETED
    assert json.loads(record.result_json or "") == again.result


async def test_pending_changes_are_flushed_when_the_handler_returns(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def handler(session: AsyncSession) -> None:
        session.add(Item(scope=scope, name=f"{scope}-pending"))  # neither flushed nor committed

    outcome = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert outcome.kind is OutcomeKind.EXECUTED
    assert await names(pg_pool, scope) == [f"{scope}-pending"]


async def test_a_failure_after_an_orm_write_leaves_nothing(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    attempts = 0

    async def handler(session: AsyncSession) -> str:
        nonlocal attempts
        attempts += 1
        session.add(Item(scope=scope, name=f"{scope}-x"))
        await session.flush()
        if attempts == 1:
            raise ConnectionResetError("the downstream call failed after the write")
        return "done"

    failed = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert failed.kind is OutcomeKind.FAILED_RETRYABLE
    assert await names(pg_pool, scope) == []
    record = await sa_store.get(scope, "k")
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    retried = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert retried.kind is OutcomeKind.EXECUTED and retried.result == "done"
    assert await names(pg_pool, scope) == [f"{scope}-x"]


async def test_session_commit_is_a_flush_the_library_commits_the_unit(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    seen: list[Any] = []

    async def commit_then_fail(session: AsyncSession) -> None:
        item = Item(scope=scope, name=f"{scope}-committed")
        session.add(item)
        await session.commit()
        # the row is in the unit's transaction, and the object was not expired
        seen.append(await session.scalar(select(func.count()).where(Item.scope == scope)))
        seen.append(item.name)
        raise RuntimeError("after session.commit()")

    outcome = await run_transactional(sa_store, scope, "k1", FP, with_session(commit_then_fail))
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE
    assert seen == [1, f"{scope}-committed"]
    assert await names(pg_pool, scope) == []  # session.commit() committed nothing by itself

    async def commit_twice(session: AsyncSession) -> int:
        session.add(Item(scope=scope, name=f"{scope}-one"))
        await session.commit()
        session.add(Item(scope=scope, name=f"{scope}-two"))
        await session.commit()
        return 2

    done = await run_transactional(sa_store, scope, "k2", FP, with_session(commit_twice))
    assert done.kind is OutcomeKind.EXECUTED
    assert await names(pg_pool, scope) == [f"{scope}-one", f"{scope}-two"]


async def test_session_rollback_rolls_back_the_whole_unit(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    later: list[BaseException] = []

    async def handler(conn: asyncpg.Connection, session: AsyncSession) -> str:
        assert connection_of(session) is conn
        await conn.execute("INSERT INTO sa_test_raw VALUES ($1, 'raw')", scope)
        session.add(Item(scope=scope, name=f"{scope}-rolled"))
        await session.flush()
        await session.rollback()
        try:  # the unit's transaction is aborted: nothing more can be written in it
            await conn.execute("INSERT INTO sa_test_raw VALUES ($1, 'after')", scope)
        except asyncpg.InFailedSQLTransactionError as exc:
            later.append(exc)
        return "the handler carried on"

    async def run(conn: asyncpg.Connection) -> Any:
        async with bound_session(conn) as session:
            return await handler(conn, session)

    # bound_session alone: the unit cannot commit (the library's commit check refuses)
    outcome = await run_transactional(sa_store, scope, "k1", FP, run)
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE and len(later) == 1
    # with_session: the same, and the failure says why
    outcome = await run_transactional(
        sa_store, scope, "k2", FP, with_session(handler, connection=True)
    )
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE
    assert isinstance(outcome.error, SessionRolledBack)
    assert await names(pg_pool, scope) == [] and await raw_notes(pg_pool, scope) == []


async def test_a_rollback_stays_a_rollback_even_if_a_savepoint_undoes_the_abort(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def handler(conn: asyncpg.Connection, session: AsyncSession) -> str:
        session.add(Item(scope=scope, name=f"{scope}-before"))
        await session.flush()
        try:
            async with savepoint(conn):  # rolled back to: the abort inside it is undone
                await session.rollback()
                raise LookupError("leave the savepoint")
        except LookupError:
            pass
        await conn.execute("INSERT INTO sa_test_raw VALUES ($1, 'after')", scope)
        return "ok"

    for key, wrap in (("k1", with_session(handler, connection=True)), ("k2", None)):
        if wrap is None:

            async def wrap(conn: asyncpg.Connection) -> Any:
                async with bound_session(conn) as session:
                    return await handler(conn, session)

        outcome = await run_transactional(sa_store, scope, key, FP, wrap)
        assert outcome.kind is OutcomeKind.FAILED_RETRYABLE, key
    assert await names(pg_pool, scope) == [] and await raw_notes(pg_pool, scope) == []


async def test_a_failed_flush_fails_the_unit_and_begin_nested_recovers_a_part(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    taken = f"{scope}-taken"
    await pg_pool.execute(
        "INSERT INTO sa_test_items (scope, name, qty, data) VALUES ('other', $1, 1, '{}')", taken
    )

    async def swallowed(session: AsyncSession) -> str:
        session.add(Item(scope=scope, name=f"{scope}-kept"))
        await session.flush()
        try:
            session.add(Item(scope=scope, name=taken))
            await session.flush()
        except IntegrityError:
            pass  # without a savepoint: the unit is rolled back all the same
        return "swallowed"

    outcome = await run_transactional(sa_store, scope, "k1", FP, with_session(swallowed))
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE
    assert await names(pg_pool, scope) == []

    async def nested(session: AsyncSession) -> str:
        session.add(Item(scope=scope, name=f"{scope}-kept"))
        await session.flush()
        try:
            async with session.begin_nested():  # a SAVEPOINT: only this part is undone
                session.add(Item(scope=scope, name=taken))
        except IntegrityError:
            pass
        return "recovered"

    outcome = await run_transactional(sa_store, scope, "k2", FP, with_session(nested))
    assert outcome.kind is OutcomeKind.EXECUTED and outcome.result == "recovered"
    assert await names(pg_pool, scope) == [f"{scope}-kept"]


async def test_twenty_concurrent_runs_of_one_key_write_one_row(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    calls = 0

    async def handler(session: AsyncSession) -> dict[str, int]:
        nonlocal calls
        calls += 1
        item = Item(scope=scope, name=f"{scope}-once")
        session.add(item)
        await session.flush()
        await asyncio.sleep(0.05)  # hold the key while the others arrive
        return {"id": item.id}

    outcomes = await asyncio.gather(
        *(run_transactional(sa_store, scope, "k", FP, with_session(handler)) for _ in range(20))
    )
    kinds = sorted(o.kind for o in outcomes)
    assert kinds.count(OutcomeKind.EXECUTED) == 1 and calls == 1
    assert set(kinds) <= {OutcomeKind.EXECUTED, OutcomeKind.REPLAYED}
    assert await names(pg_pool, scope) == [f"{scope}-once"]
    assert len({json.dumps(o.result) for o in outcomes}) == 1


# --- results as models --------------------------------------------------------------------------


async def test_models_and_dataclasses_are_stored_and_replayed_as_json(
    sa_store: PostgresStore, scope: str
) -> None:
    async def handler(session: AsyncSession) -> Receipt:
        item = Item(scope=scope, name=f"{scope}-r", qty=3)
        session.add(item)
        await session.flush()
        return Receipt(ItemOut.model_validate(item), "thanks")

    first = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert first.kind is OutcomeKind.EXECUTED
    replay = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert replay.result == {
        "item": {"id": first.result.item.id, "name": f"{scope}-r", "qty": 3},
        "note": "thanks",
    }


async def test_an_orm_object_is_no_result_and_the_delivery_is_dead_lettered(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    # -> Any: an annotation of the ORM class itself refuses at decoration (no result type)
    async def handler(message: ConsumerMessage, session: AsyncSession) -> Any:
        item = Item(scope=scope, name=f"{scope}-orm")
        session.add(item)
        return item  # a view of a row, not a value

    consumer = idempotent_consumer(sa_store, scope=scope, key=header("idempotency-key"))(
        with_session(handler)
    )
    message = ConsumerMessage(body=b"{}", headers={"idempotency-key": b"k"})
    verdict = await consumer.process(message)
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "unstorable_result"
    assert verdict.outcome is not None and isinstance(verdict.outcome.error, UnstorableResult)
    assert "SQLAlchemy ORM object (Item)" in str(verdict.outcome.error)
    assert await names(pg_pool, scope) == []


async def test_with_session_handler_replays_its_model(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def handler(message: ConsumerMessage, session: AsyncSession) -> ItemOut:
        item = Item(scope=scope, name=f"{scope}-typed", qty=3, data={"k": [1]})
        session.add(item)
        await session.flush()
        return ItemOut.model_validate(item)

    consumer = idempotent_consumer(sa_store, scope=scope, key=header("idempotency-key"))(
        with_session(handler)
    )
    message = ConsumerMessage(body=b"{}", headers={"idempotency-key": b"k"})
    first = await consumer.process(message)
    again = await consumer.process(ConsumerMessage(body=b"{}", headers=message.headers))
    assert again.duplicate and type(again.result) is ItemOut and again.result == first.result
    assert await names(pg_pool, scope) == [f"{scope}-typed"]


async def test_a_model_json_cannot_hold_is_a_clear_unstorable_result(
    sa_store: PostgresStore, scope: str
) -> None:
    class Reading(BaseModel):
        value: float

    @dataclasses.dataclass
    class Blob:
        data: bytes

    async def nan(session: AsyncSession) -> Reading:
        return Reading(value=float("nan"))

    async def blob(session: AsyncSession) -> Blob:
        return Blob(b"\xff\x00")

    for key, handler in (("nan", nan), ("blob", blob)):
        outcome = await run_transactional(sa_store, scope, key, FP, with_session(handler))
        assert outcome.kind is OutcomeKind.FAILED_RETRYABLE, key
        assert isinstance(outcome.error, UnstorableResult), key


# --- the two pools ------------------------------------------------------------------------------


async def test_the_asyncpg_pool_connections_keep_their_own_json_codec(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def handler(session: AsyncSession) -> Any:
        session.add(Item(scope=scope, name=f"{scope}-j", data={"a": 1}))
        await session.flush()
        return (await session.scalars(select(Item.data).where(Item.scope == scope))).one()

    outcome = await run_transactional(store, scope, "k", FP, with_session(handler))
    assert outcome.result == {"a": 1}  # SQLAlchemy decoded the JSON column itself
    for _ in range(pg_pool.get_size()):  # and no pooled connection decodes json on its own
        raw = await pg_pool.fetchval("SELECT data FROM sa_test_items WHERE scope = $1", scope)
        assert isinstance(raw, str) and json.loads(raw) == {"a": 1}


async def test_the_engine_pool_serves_the_whole_store_and_replaces_a_broken_connection(
    pg_dsn: str, pg_pool: asyncpg.Pool, scope: str
) -> None:
    engine = create_async_engine(
        make_url(pg_dsn).set(drivername="postgresql+asyncpg"), pool_size=1, max_overflow=0
    )
    try:
        store = engine_store(engine)
        pool = store.pool
        assert isinstance(pool, EnginePool)
        conn = await pool.acquire()
        assert await conn.fetchval("SELECT 1") == 1
        conn.terminate()  # broken while lent: the engine must not hand it out again
        await pool.release(conn)

        async def handler(session: AsyncSession) -> int:
            session.add(Item(scope=scope, name=f"{scope}-e"))
            return 1

        outcome = await run_transactional(store, scope, "k", FP, with_session(handler))
        assert outcome.kind is OutcomeKind.EXECUTED
        reservation = await store.reserve(scope, "k", FP)
        assert reservation.record.result == 1  # the store's JSON reads, on engine connections
        assert await names(pg_pool, scope) == [f"{scope}-e"]
        assert engine.pool.checkedout() == 0
    finally:
        await engine.dispose()


async def test_the_engine_gets_no_listener_and_its_own_listeners_still_run(
    engine: AsyncEngine, pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    app_engine = create_async_engine(make_url(pg_dsn).set(drivername="postgresql+asyncpg"))
    _ = engine  # its tables
    try:
        sa_store = engine_store(app_engine, schema=store.schema)
        # a listener on the engine would make every statement of the application dispatch events
        assert not app_engine.sync_engine._has_events
        began: list[int] = []

        @event.listens_for(app_engine.sync_engine, "begin")
        def on_begin(conn: Any) -> None:  # an application's listener that does I/O
            began.append(conn.exec_driver_sql("SELECT 1").scalar())

        async def handler(session: AsyncSession) -> int:
            session.add(Item(scope=scope, name=f"{scope}-l"))
            await session.rollback()  # still rolls the whole unit back
            return 1

        outcome = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
        assert isinstance(outcome.error, SessionRolledBack)
        assert began == [1]

        async def again(session: AsyncSession) -> int:
            session.add(Item(scope=scope, name=f"{scope}-l"))
            return 2

        outcome = await run_transactional(sa_store, scope, "k", FP, with_session(again))
        assert outcome.kind is OutcomeKind.EXECUTED and began == [1, 1]
        assert await names(pg_pool, scope) == [f"{scope}-l"]
        assert app_engine.pool.checkedout() == 0
    finally:
        await app_engine.dispose()


# --- HTTP ---------------------------------------------------------------------------------------


def orders_app(store: PostgresStore, scope: str) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)

    @app.post("/items", status_code=201)
    @idempotent(required=True)
    async def create(body: dict[str, Any], session: IdempotentSession) -> Any:
        item = Item(scope=scope, name=body["name"])
        session.add(item)
        await session.commit()  # a flush: the middleware commits it with the response
        if body.get("fail"):
            return JSONResponse({"id": item.id}, status_code=503)
        if body.get("rollback"):
            await session.rollback()
        return {"id": item.id, "name": item.name}

    @app.post("/both", status_code=201)
    @idempotent(required=True)
    async def both(session: IdempotentSession, conn: IdempotentTransaction) -> Any:
        assert connection_of(session) is conn  # one transaction, two ways to write in it
        await conn.execute("INSERT INTO sa_test_raw VALUES ($1, 'raw')", scope)
        session.add(Item(scope=scope, name=f"{scope}-both"))
        return {"ok": True}

    @app.post("/optional")
    async def optional(body: dict[str, Any], session: IdempotentSession) -> Any:
        return {"never": "reached without a key"}

    return app


async def test_fastapi_dependency_commits_with_the_response_and_fails_as_a_unit(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    app = orders_app(sa_store, scope)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

        async def post(path: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
            headers = {"idempotency-key": key} if key else {}
            return await client.post(path, json=body, headers=headers)

        created = await post("/items", f"{scope}-1", {"name": f"{scope}-a"})
        assert created.status_code == 201
        replayed = await post("/items", f"{scope}-1", {"name": f"{scope}-a"})
        assert replayed.content == created.content
        assert replayed.headers["idempotent-replayed"] == "true"
        failed = await post("/items", f"{scope}-2", {"name": f"{scope}-b", "fail": True})
        assert failed.status_code == 503
        rolled = await post("/items", f"{scope}-3", {"name": f"{scope}-c", "rollback": True})
        assert rolled.status_code == 500
        assert "request-not-committed" in rolled.json()["type"]
        both = await post("/both", f"{scope}-5", {})
        assert both.status_code == 201
        unkeyed = await post("/optional", None, {})
        assert unkeyed.status_code == 500  # NotInTransaction: no key, no transaction
        concurrent = await asyncio.gather(
            *(post("/items", f"{scope}-4", {"name": f"{scope}-d"}) for _ in range(20))
        )
        assert {r.status_code for r in concurrent} <= {201, 409}
        assert len({r.content for r in concurrent if r.status_code == 201}) == 1
    assert await names(pg_pool, scope) == [f"{scope}-a", f"{scope}-both", f"{scope}-d"]
    assert await raw_notes(pg_pool, scope) == ["raw"]


async def test_starlette_helper_and_the_typed_transaction(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def create(request: Request) -> JSONResponse:
        body = await request.json()
        async with request_session(request) as session:
            item = Item(scope=scope, name=body["name"])
            session.add(item)
            await session.flush()
        return JSONResponse({"id": item.id}, status_code=201)

    app = Starlette(routes=[Route("/items", create, methods=["POST"])])
    wrapped = IdempotencyMiddleware(app, store=sa_store, shared_keys=True)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await client.post(
            "/items", json={"name": f"{scope}-s"}, headers={"idempotency-key": f"{scope}-one"}
        )
        again = await client.post(
            "/items", json={"name": f"{scope}-s"}, headers={"idempotency-key": f"{scope}-one"}
        )
        with pytest.raises(NotInTransaction, match="no Idempotency-Key"):
            await client.post("/items", json={"name": f"{scope}-none"})
    assert first.status_code == 201 and again.content == first.content
    assert await names(pg_pool, scope) == [f"{scope}-s"]


async def test_a_session_outside_an_idempotent_unit_is_refused(
    engine: AsyncEngine, scope: str
) -> None:
    async with AsyncSession(engine) as session:
        with pytest.raises(Exception, match="not bound to an idempotency transaction"):
            connection_of(session)
    _ = unique  # keep the helper import for scope names


async def test_a_statement_error_after_rollback_names_the_abort(
    sa_store: PostgresStore, scope: str
) -> None:
    errors: list[str] = []

    async def handler(session: AsyncSession) -> None:
        await session.rollback()
        try:
            await session.execute(text("SELECT 1"))
        except DBAPIError as exc:
            errors.append(str(exc.orig))

    outcome = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert isinstance(outcome.error, SessionRolledBack)
    assert errors and "aborted" in errors[0]


async def test_a_batch_handler_writes_every_member_through_one_session(
    sa_store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def handler(messages: list[ConsumerMessage], session: AsyncSession) -> list[str]:
        names = [m.json()["name"] for m in messages]
        session.add_all(Item(scope=scope, name=name) for name in names)
        return names

    consumer = idempotent_consumer(
        sa_store, scope=scope, key=header("idempotency-key"), batch=True
    )(with_session(handler))
    batch = [
        ConsumerMessage(
            body=json.dumps({"name": f"{scope}-{i}"}).encode(),
            headers={"idempotency-key": f"k{i}".encode()},
        )
        for i in range(3)
    ]
    verdicts = await consumer.process_batch(batch)
    assert [v.action for v in verdicts] == [Action.ACK] * 3
    again = await consumer.process_batch([m.fresh() for m in batch])
    assert all(v.duplicate for v in again)
    assert await names(pg_pool, scope) == [f"{scope}-{i}" for i in range(3)]


async def test_json_columns_and_json_string_results_read_back_as_written(
    sa_store: PostgresStore, scope: str
) -> None:
    async def handler(session: AsyncSession) -> str:
        session.add(Item(scope=scope, name=f"{scope}-json", data={"a": [1, "x"]}))
        await session.flush()
        data = await session.scalar(select(Item.data).where(Item.scope == scope))
        assert data == {"a": [1, "x"]}  # SQLAlchemy's JSON column, decoded
        return "123"  # a JSON string that looks like a number

    first = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    replay = await run_transactional(sa_store, scope, "k", FP, with_session(handler))
    assert first.result == replay.result == "123"
    record = await sa_store.get(scope, "k")
    assert record is not None and record.result_json == '"123"'
