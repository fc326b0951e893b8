"""SQLAlchemy 2.0: an ``AsyncSession`` bound to the idempotency transaction.

The library opens the idempotency transaction itself (a raw ``BEGIN`` on an asyncpg connection)
and owns its ``COMMIT`` (checked, see `consumer_idem.commit`). A session from
[`bound_session`][consumer_idem.sqlalchemy.bound_session] runs its statements on that connection,
inside that transaction, so the
ORM writes commit together with the idempotency record or not at all::

    store = engine_store(engine)                 # one pool: the store acquires through the engine

    @idempotent_consumer(store, scope="orders")
    @with_session
    async def handle(message: ConsumerMessage, session: AsyncSession) -> dict:
        session.add(Order(sku=..., qty=...))
        await session.commit()                   # a flush: the unit commits with its record
        return {"ok": True}

What the session's own transaction calls do inside an idempotent unit:

* ``session.commit()`` flushes and ends the session's transaction, nothing more: the library
  commits the unit, with its record, once the handler has returned. (The session joins the
  unit with ``join_transaction_mode="rollback_only"``, SQLAlchemy's mode for a transaction the
  caller owns.) Objects are not expired by it (``expire_on_commit=False``).
* ``session.rollback()`` (also a failed flush, or ``async with session.begin():`` left by an
  exception) rolls back the **whole unit**: the transaction is aborted on the spot, so every
  later statement of the handler fails, and nothing of the unit commits. A consumer's delivery
  is ``failed_retryable`` ([`SessionRolledBack`][consumer_idem.sqlalchemy.SessionRolledBack]), an
  HTTP request answers 500
  ``request-not-committed``. To undo only a part, use ``async with session.begin_nested():``
  (a SAVEPOINT).
* Pending ORM changes are flushed when the handler returns (before the library's COMMIT).

Writes through any other session, engine connection or pool are **not** part of the unit: they
commit on their own, whatever happens to the idempotency record.

Entry points: [`with_session`][consumer_idem.sqlalchemy.with_session] (``@idempotent_consumer``
handlers and
[`run_transactional`][consumer_idem.execution.run_transactional]),
[`request_session`][consumer_idem.sqlalchemy.request_session] (Starlette),
``consumer_idem.sqlalchemy.fastapi`` (FastAPI's ``Depends``) and
``consumer_idem.sqlalchemy.faststream`` (FastStream's injection).

The store may run on the application's SQLAlchemy engine
([`EnginePool`][consumer_idem.sqlalchemy.EnginePool], asyncpg driver:
one pool for both) or on an asyncpg pool; a session binds to the unit's connection either way.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import sqlalchemy  # noqa: F401 - the sqlalchemy extra
except ImportError as exc:
    raise missing("sqlalchemy", exc, __name__) from exc

import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, overload

import asyncpg
from sqlalchemy import event
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    create_async_engine,
)
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from sqlalchemy.util import greenlet_spawn

from consumer_idem.errors import ConfigurationError, SessionRolledBack
from consumer_idem.stores.postgres.store import PostgresStore

__all__ = [
    "EnginePool",
    "SessionRolledBack",
    "bound_session",
    "connection_of",
    "engine_store",
    "request_session",
    "rolled_back",
    "with_session",
]

log = logging.getLogger("consumer_idem.sqlalchemy")

R = TypeVar("R")
M = TypeVar("M")

#: where a bound session's :class:`_Binding` is kept: in ``Session.info``, and in the
#: connection's ``Connection.info`` while the session is bound
_BINDING = "consumer_idem.binding"
#: aborts the idempotency transaction in place: every later statement fails, COMMIT answers
#: ROLLBACK, the commit check refuses (see consumer_idem.commit). Nothing of the unit commits.
_DOOM = (
    "DO $consumer_idem$ BEGIN RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = "
    "'consumer-idem: the session rolled back: the whole idempotent unit is rolled back'; "
    "END $consumer_idem$"
)


# --- one pool: the store acquires through the application's engine ----------------------------


class _UnitConnection(Connection):
    """SQLAlchemy's connection on a unit's asyncpg connection (an
    [`EnginePool`][consumer_idem.sqlalchemy.EnginePool]
    checkout, or an asyncpg pool's connection lent for one session).

    A rollback of its SQLAlchemy transaction (``session.rollback()``, a failed flush, a
    ``begin()`` block left by an exception) aborts the unit's transaction. That is caught here,
    where SQLAlchemy fires its ``rollback`` event, rather than by a listener: a listener (on
    the engine, or on this class) makes every statement dispatch every connection event, and
    one on the engine would do so for all of the application's connections."""

    def _rollback_impl(self) -> None:
        binding = self.info.get(_BINDING)
        if isinstance(binding, _Binding):
            _abort(binding)
        super()._rollback_impl()


#: the application's engine and its connection behind each asyncpg connection an
#: :class:`EnginePool` has lent out
_ENGINE_CONNECTIONS: dict[Any, tuple[AsyncEngine, _UnitConnection]] = {}


class EnginePool:
    """An asyncpg-pool face on a SQLAlchemy `AsyncEngine`
    (``postgresql+asyncpg``), so a [`PostgresStore`][consumer_idem.PostgresStore] and the
    application
    share one pool: ``PostgresStore(EnginePool(engine))``.

    Each ``acquire()`` checks a connection out of the engine's pool (its ``pool_size``,
    ``max_overflow`` and ``pool_timeout`` apply) and hands the store the asyncpg connection
    inside it; release checks it back in. The checkout is set to ``AUTOCOMMIT`` for the time
    it is lent (the driver adapter must not begin transactions of its own: the library sends
    its own ``BEGIN``; SQLAlchemy resets the level at check-in). A connection that broke while
    lent is invalidated, so the engine replaces it. The engine stays the application's: this
    never disposes it. One change to it: JSON columns are decoded by SQLAlchemy rather than by
    an asyncpg codec (the same values), so the store reads back the JSON text it wrote.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(
                "EnginePool takes a SQLAlchemy AsyncEngine (create_async_engine("
                f"'postgresql+asyncpg://...')), not {type(engine).__name__}"
            )
        if engine.dialect.driver != "asyncpg":
            raise ConfigurationError(
                "EnginePool needs an engine on the asyncpg driver (postgresql+asyncpg://...), "
                f"not {engine.dialect.name}+{engine.dialect.driver}"
            )
        self.engine = engine
        _decode_json_in_sqlalchemy(engine)

    def acquire(self, *, timeout: float | None = None) -> _EngineCheckout:
        """A checkout: ``async with pool.acquire() as conn`` or ``conn = await
        pool.acquire()`` (then `release`). The engine's ``pool_timeout`` bounds the wait
        (``timeout`` is accepted for the asyncpg pool's signature)."""
        return _EngineCheckout(self)

    async def release(self, conn: Any) -> None:
        """Check ``conn`` (from ``await acquire()``) back in to the engine's pool."""
        lent = _ENGINE_CONNECTIONS.pop(conn, None)
        if lent is None:
            raise ValueError("this connection was not acquired from this EnginePool")
        await _check_in(conn, lent[1])

    async def close(self) -> None:
        """Nothing to do: the engine is the application's (``await engine.dispose()``)."""

    def __repr__(self) -> str:
        return f"<EnginePool {self.engine.url.render_as_string(hide_password=True)}>"


def engine_store(engine: AsyncEngine, **options: Any) -> PostgresStore:
    """A [`PostgresStore`][consumer_idem.PostgresStore] on the application's engine (one pool for
    the
    store and the application: see [`EnginePool`][consumer_idem.sqlalchemy.EnginePool]).
    ``options``: as for the store."""
    return PostgresStore(cast(asyncpg.Pool, EnginePool(engine)), **options)


#: marks a connection (its pool record's ``info``) whose JSON codecs are asyncpg's own again
_TEXT_JSON = "consumer_idem.text_json"


def _decode_json_in_sqlalchemy(engine: AsyncEngine) -> None:
    """The store reads its ``json`` result column as the text it wrote (a JSON string result
    must stay distinguishable from JSON text), so the engine's connections get asyncpg's own
    json/jsonb codecs back, and SQLAlchemy decodes JSON columns itself (as it does for other
    drivers): the same values for the application, decoded in Python instead of in asyncpg."""
    dialect = engine.dialect
    if dialect.supports_native_json_deserialization is False:
        return
    dialect.supports_native_json_deserialization = False
    engine.clear_compiled_cache()  # result processors of JSON columns read so far

    @event.listens_for(engine.sync_engine.pool, "checkout")
    def _text_json(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if record.info.get(_TEXT_JSON):
            return
        dbapi_connection.run_async(_reset_json_codecs)
        record.info[_TEXT_JSON] = True


async def _reset_json_codecs(conn: Any) -> None:
    for name in ("json", "jsonb"):
        await conn.reset_type_codec(name, schema="pg_catalog")


def _connect(engine: AsyncEngine) -> _UnitConnection:
    """Check a connection out of the engine's pool (in SQLAlchemy's greenlet: the pool may
    connect, ping or recycle), in ``AUTOCOMMIT`` (reset at check-in) and in one hop: no
    `AsyncConnection` wrapper, which only a session needs (see
    [`bound_session`][consumer_idem.sqlalchemy.bound_session])."""
    connection = _UnitConnection(engine.sync_engine)
    try:
        connection.execution_options(isolation_level="AUTOCOMMIT")
    except BaseException:
        connection.close()
        raise
    return connection


class _EngineCheckout:
    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        self._conn: Any = None

    async def _checkout(self) -> Any:
        engine = self._pool.engine
        connection = await greenlet_spawn(_connect, engine)
        # checked out just now, so valid: reading it needs no I/O (nor a greenlet)
        raw = connection.connection.driver_connection
        _ENGINE_CONNECTIONS[raw] = (engine, connection)
        self._conn = raw
        return raw

    def __await__(self) -> Any:
        return self._checkout().__await__()

    async def __aenter__(self) -> Any:
        return await self._checkout()

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._pool.release(self._conn)
            self._conn = None


async def _check_in(raw: Any, connection: Connection) -> None:
    try:
        if not raw.is_closed() and raw.is_in_transaction():
            # The library never leaves a transaction open; if it ever did, SQLAlchemy's reset
            # on check-in would not see it (the adapter did not begin it)
            await raw.execute("ROLLBACK")
    finally:
        # broken while lent (the store saw it fail): the engine must not hand it out again
        close = _invalidate_and_close if raw.is_closed() else _close
        await greenlet_spawn(close, connection)  # one hop: the pool's check-in may do I/O


def _close(connection: Connection) -> None:
    connection.close()


def _invalidate_and_close(connection: Connection) -> None:
    try:
        connection.invalidate()
    finally:
        connection.close()


# --- sessions on a connection that is not the engine's: the lent-connection dialect -------------


class _LentDialect(PGDialect_asyncpg):
    """The asyncpg dialect for a connection SQLAlchemy only borrows (an asyncpg pool's, during
    one unit). It never closes it (its pool owns it) and installs no type codecs on it (they
    would outlive the unit and change what the pool's other users read): JSON is decoded by
    SQLAlchemy instead."""

    supports_statement_cache = True
    supports_native_json_deserialization = False

    async def setup_asyncpg_json_codec(self, conn: Any) -> None:
        return None

    async def setup_asyncpg_jsonb_codec(self, conn: Any) -> None:
        return None

    def do_close(self, dbapi_connection: Any) -> None:
        return None

    def do_terminate(self, dbapi_connection: Any) -> None:
        return None


registry.register("postgresql.consumer_idem_lent", __name__, "_LentDialect")

_lending: ContextVar[Any] = ContextVar("consumer_idem_lent_connection")
_lent_engine: AsyncEngine | None = None


async def _lent_connection() -> Any:
    return _lending.get()


def _lender() -> AsyncEngine:
    """The engine that wraps a lent connection (one per process: it holds no connection)."""
    global _lent_engine
    if _lent_engine is None:
        _lent_engine = create_async_engine(
            "postgresql+consumer_idem_lent://",
            async_creator=_lent_connection,
            poolclass=NullPool,
            pool_reset_on_return=None,
            isolation_level="AUTOCOMMIT",
        )
    return _lent_engine


async def _sa_connection(conn: Any) -> tuple[AsyncEngine, _UnitConnection, bool]:
    """SQLAlchemy's connection on ``conn`` and its engine: the
    [`EnginePool`][consumer_idem.sqlalchemy.EnginePool] checkout's,
    or a new one that borrows ``conn`` (``True``: close it after the unit)."""
    lent = _ENGINE_CONNECTIONS.get(conn)
    if lent is not None:
        return lent[0], lent[1], False
    engine = _lender()
    token = _lending.set(conn)
    try:
        return engine, await greenlet_spawn(_UnitConnection, engine.sync_engine), True
    finally:
        _lending.reset(token)


# --- the binding ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Binding:
    """One bound session's hold on a unit's connection."""

    conn: Any
    #: SQLAlchemy's connection on ``conn``
    connection: Connection
    #: a rollback now rolls back the unit (false while the binding is taken down)
    active: bool = True
    rolled_back: bool = False
    #: SQLAlchemy's side of the unit's transaction is open
    bound: bool = True


def _on_rollback(connection: Connection) -> None:
    binding = connection.info.get(_BINDING)
    if isinstance(binding, _Binding):
        _abort(binding)


if not callable(getattr(Connection, "_rollback_impl", None)):  # pragma: no cover
    # a SQLAlchemy without the hook: the (slower) documented event, on our connections only
    del _UnitConnection._rollback_impl
    event.listen(_UnitConnection, "rollback", _on_rollback)


class _BoundSession(Session):
    """The sync side of a bound session: ``rollback()`` rolls the unit back even when the
    session has nothing of its own to roll back (after a ``commit()``, which only flushed)."""

    def rollback(self) -> None:
        super().rollback()
        binding = self.info.get(_BINDING)
        if isinstance(binding, _Binding):
            _abort(binding)


def _abort(binding: _Binding) -> None:
    """The bound session rolled back: so does the unit (inside SQLAlchemy's greenlet)."""
    if not binding.active or binding.rolled_back:
        return
    binding.rolled_back = True
    log.warning(
        "the bound session rolled back: the whole idempotent unit is rolled back (use "
        "session.begin_nested() to undo only a part)"
    )
    dbapi = binding.connection.connection.dbapi_connection
    dbapi.run_async(lambda _: _doom(binding.conn))  # type: ignore[union-attr]


async def _doom(conn: Any) -> None:
    """Abort the unit's transaction (see ``_DOOM``); already aborted is as good."""
    # P0001 (ours) or 25P02 (aborted already): either way it is aborted now
    with contextlib.suppress(asyncpg.PostgresError):
        await conn.execute(_DOOM)


@contextlib.asynccontextmanager
async def bound_session(conn: asyncpg.Connection) -> AsyncIterator[AsyncSession]:
    """An `AsyncSession` on ``conn``, the connection of an
    idempotent unit (a transactional handler's ``conn``, an HTTP request's
    ``state.idempotency.connection``), inside its transaction.

    Its statements are part of the unit: they commit with the idempotency record, or not at
    all. ``session.commit()`` flushes (the library commits); ``session.rollback()`` rolls the
    whole unit back (see the module docstring). Pending changes are flushed when the block
    ends without an exception."""
    engine, connection, borrowed = await _sa_connection(conn)
    binding = _Binding(conn, connection)
    session: AsyncSession | None = None
    try:
        # SQLAlchemy's view of the unit's transaction (the autocommit adapter sends nothing),
        # which the session joins without the right to commit it. Beginning it does no I/O
        # unless a "begin" listener of the application's might: only then in a greenlet.
        if connection.dispatch.begin:
            await greenlet_spawn(connection.begin)
        else:
            connection.begin()
        binding.connection.info[_BINDING] = binding
        session = AsyncSession(
            bind=AsyncConnection(engine, connection),
            join_transaction_mode="rollback_only",
            expire_on_commit=False,
            sync_session_class=_BoundSession,
        )
        session.info[_BINDING] = binding
        yield session
        if binding.rolled_back:
            await _doom(conn)  # aborted still, whatever ran since (a ROLLBACK TO SAVEPOINT)
        else:
            await session.run_sync(_flush_and_release, binding)  # one greenlet hop for all
    finally:
        binding.active = False
        if session is not None and binding.bound:
            await session.run_sync(_release, binding)
        elif binding.bound:
            await greenlet_spawn(connection.rollback)
        if borrowed:
            await greenlet_spawn(_close, connection)


def _flush_and_release(session: Session, binding: _Binding) -> None:
    session.flush()
    binding.active = False
    _release(session, binding)


def _release(session: Session, binding: _Binding) -> None:
    """End the session and SQLAlchemy's side of the unit's transaction (nothing reaches the
    server: the adapter is in autocommit). The unit's connection stays as it is."""
    connection = session.bind
    session.close()
    assert isinstance(connection, Connection)
    connection.info.pop(_BINDING, None)
    connection.rollback()
    binding.bound = False


def connection_of(session: AsyncSession) -> asyncpg.Connection:
    """The unit's asyncpg connection behind a bound session (for raw statements in the same
    transaction)."""
    return _binding_of(session).conn  # type: ignore[no-any-return]


def rolled_back(session: AsyncSession) -> bool:
    """Did this bound session roll the unit back (``session.rollback()``, a failed flush)? The
    unit can then only fail: the library's COMMIT check refuses it."""
    return _binding_of(session).rolled_back


def _binding_of(session: AsyncSession) -> _Binding:
    binding = session.info.get(_BINDING)
    if not isinstance(binding, _Binding):
        raise ConfigurationError("this session is not bound to an idempotency transaction")
    return binding


# --- consumers and run_transactional ----------------------------------------------------------


@overload
def with_session(
    handler: Callable[[AsyncSession], Awaitable[R]], *, connection: Literal[False] = False
) -> Callable[[asyncpg.Connection], Awaitable[R]]: ...


@overload
def with_session(
    handler: Callable[[M, AsyncSession], Awaitable[R]], *, connection: Literal[False] = False
) -> Callable[[M, asyncpg.Connection], Awaitable[R]]: ...


@overload
def with_session(
    handler: Callable[[asyncpg.Connection, AsyncSession], Awaitable[R]],
    *,
    connection: Literal[True],
) -> Callable[[asyncpg.Connection], Awaitable[R]]: ...


@overload
def with_session(
    handler: Callable[[M, asyncpg.Connection, AsyncSession], Awaitable[R]],
    *,
    connection: Literal[True],
) -> Callable[[M, asyncpg.Connection], Awaitable[R]]: ...


def with_session(
    handler: Callable[..., Awaitable[Any]], *, connection: bool = False
) -> Callable[..., Awaitable[Any]]:
    """Adapt a handler that writes through a session to the transactional handler signature,
    whose last argument is the unit's connection:

    * ``handler(session)`` for [`run_transactional`][consumer_idem.execution.run_transactional]
    (with
      ``connection=True``, ``handler(conn, session)``);
    * ``handler(message, session)`` (or ``handler(messages, session)`` in batch mode) for
      ``@idempotent_consumer``; with ``connection=True``, ``handler(message, conn, session)``.

    The session is bound to the unit ([`bound_session`][consumer_idem.sqlalchemy.bound_session]). A
    handler whose session rolled
    back fails with [`SessionRolledBack`][consumer_idem.sqlalchemy.SessionRolledBack]: nothing of
    the unit commits."""
    if not inspect.iscoroutinefunction(handler) and not inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    ):
        raise TypeError(f"{getattr(handler, '__name__', handler)!r} is not an async function")

    @functools.wraps(handler)
    async def run(*args: Any) -> Any:
        *head, conn = args
        async with bound_session(conn) as session:
            result = await handler(*head, *((conn,) if connection else ()), session)
        if rolled_back(session):
            raise SessionRolledBack(
                "the handler's session rolled back (session.rollback() or a failed flush): "
                "the whole idempotent unit was rolled back, nothing of it committed"
            )
        return result

    return run


# --- HTTP: Starlette and FastAPI ----------------------------------------------------------------


def _transaction_of(request: Any) -> asyncpg.Connection:
    from consumer_idem.http import transaction_of

    return transaction_of(request)


@contextlib.asynccontextmanager
async def request_session(request: Any) -> AsyncIterator[AsyncSession]:
    """Starlette: the session of the current idempotent request (a transactional route, with an
    ``Idempotency-Key``), bound to its transaction::

        async def create(request: Request) -> Response:
            async with request_session(request) as session:
                session.add(Order(...))
                await session.flush()
                ...

    Raises [`NotInTransaction`][consumer_idem.http.NotInTransaction] on a request the middleware
    does not
    hold in a transaction (no key, a two-phase route, a fail-open bypass)."""
    async with bound_session(_transaction_of(request)) as session:
        yield session
