"""The PostgreSQL idempotency store: reservations and every state transition.

Every write after a reservation is conditional on the owner token (fencing), and every database
failure surfaces as a library error so that no caller proceeds unprotected: an outage as
:class:`StoreUnavailable` (wait it out), a missing schema as :class:`SchemaMissing`, and only
what the message's data caused as :class:`StoreRejected` (see ``pg_errors``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import asyncpg

from consumer_idem.commit import commit, rollback
from consumer_idem.errors import (
    ConsumerIdemError,
    KeyHeld,
    LeaseLost,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
)
from consumer_idem.metrics import Metrics
from consumer_idem.stores.base import (
    DEFAULT_LEASE,
    Retention,
    StoreBase,
    checked_duration,
)
from consumer_idem.stores.cache import CompletedCache
from consumer_idem.stores.postgres import errors as pg_errors
from consumer_idem.stores.postgres import migrate
from consumer_idem.stores.postgres.dsn_pool import DsnPool
from consumer_idem.stores.postgres.fast_path import FastPath
from consumer_idem.stores.postgres.maintenance import Maintenance
from consumer_idem.stores.postgres.outbox import Outbox
from consumer_idem.stores.postgres.pooler import Pooler, check_pool, validate_pooler
from consumer_idem.stores.postgres.reconciliation import Reconciliation
from consumer_idem.stores.postgres.redispatch import RedispatchOutbox
from consumer_idem.stores.postgres.wrong_node import WrongNode
from consumer_idem.stores.results import encode_result
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Eviction,
    Record,
    Resolution,
    ResultKind,
    Status,
    StoredResponse,
)

#: how long a refusal's check waits for a pooled connection to ask on (seconds)
_PROBE_ACQUIRE_S = 2.0

log = logging.getLogger("consumer_idem.stores.postgres.store")

T = TypeVar("T")


class Acquiring(Protocol):
    """A pending checkout: awaited for a connection, or used as ``async with``."""

    def __await__(self) -> Generator[Any, None, Any]: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: object) -> Any: ...


class ConnectionPool(Protocol):
    """What the store needs of a pool: an asyncpg ``Pool``, or an adapter lending another
    pool's asyncpg connections (``consumer_idem.sqlalchemy.EnginePool`` for an SQLAlchemy
    ``AsyncEngine``, so an application keeps one pool)."""

    def acquire(self, *, timeout: float | None = None) -> Acquiring: ...

    async def release(self, connection: Any) -> Any: ...


class PostgresStore(StoreBase):
    """Idempotency records in PostgreSQL, one row per (scope, key).

    ``pool`` is an asyncpg pool; the store never closes it. Methods taking ``conn`` run on that
    connection (inside the caller's transaction) instead of a pooled one, so the caller's own
    writes and the store's transition commit together.

    This class holds the reservation state machine and the owner transitions; its other jobs
    are parts of their own: ``fast_path`` (:class:`FastPath`, the claim engine's transactional
    path), ``reconciliation`` (:class:`Reconciliation`), ``redispatch``
    (:class:`RedispatchOutbox`, the originals kept for ``unknown`` records), ``outbox``
    (:class:`Outbox`, the transactional outbox: messages handlers publish through
    ``outbox_for(conn)``) and ``maintenance`` (:class:`Maintenance`: sweep, prune, stats and the
    key listing, with typed reports).

    ``pooler="transaction"``: the pool reaches PostgreSQL through a transaction pooler
    (PgBouncer ``pool_mode=transaction``, most managed providers' pooled ports); create it with
    ``statement_cache_size=0`` (:func:`~consumer_idem.stores.postgres.pooler.create_pool`).
    """

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        schema: str = "consumer_idem",
        lease: timedelta | float = DEFAULT_LEASE,
        retention: Retention = None,
        metrics: Metrics | None = None,
        hash_invalid_keys: bool = False,
        command_timeout: float = 30.0,
        cache: CompletedCache | None = None,
        pooler: Pooler = None,
    ) -> None:
        super().__init__(
            lease=lease, retention=retention, metrics=metrics, hash_invalid_keys=hash_invalid_keys
        )
        self.pool = pool
        #: ``"transaction"``: behind a transaction pooler, nothing lives on a server connection
        #: across transactions (see ``consumer_idem.stores.postgres.pooler``)
        self.pooler = validate_pooler(pooler)
        #: optional Redis cache of completed records (Postgres stays the authority)
        self.cache = cache
        self.schema = migrate.validate_schema(schema)
        if cache is not None:
            cache.attach(self)  # counts in our metrics, keys entries by our database and schema
        self.command_timeout = command_timeout
        self.table = f'"{self.schema}".idempotency_records'
        self._reserve_sql = (
            f'SELECT decision, zombie, rec FROM "{self.schema}".reserve($1, $2, $3, $4, $5, $6)'
        )
        #: episodes of a server that cannot take writes (read-only, in recovery)
        self.wrong_node = WrongNode()
        self.fast_path = FastPath(self)
        self.reconciliation = Reconciliation(self)
        self.redispatch = RedispatchOutbox(self)
        self.outbox = Outbox(self)
        self.maintenance = Maintenance(self)

    @classmethod
    def from_dsn(
        cls,
        dsn: str,
        *,
        schema: str = "consumer_idem",
        pooler: Pooler = None,
        lease: timedelta | float = DEFAULT_LEASE,
        retention: Retention = None,
        metrics: Metrics | None = None,
        hash_invalid_keys: bool = False,
        command_timeout: float = 30.0,
        cache: CompletedCache | None = None,
        **pool_options: Any,
    ) -> PostgresStore:
        """A store made at import time: its asyncpg pool (``asyncpg.create_pool(dsn,
        **pool_options)``, see :class:`DsnPool`) opens on first use, or when you await
        ``store.open()`` (or enter ``async with store:``) in your app's start-up, and closes
        with ``await store.close()``. Tasks that use it first at the same moment share one
        pool; a use after ``close()`` opens a new one. ``store.pool`` also runs your own
        queries (``await store.pool.execute(...)``)."""
        return cls(
            DsnPool(dsn, pooler=pooler, **pool_options),
            schema=schema,
            lease=lease,
            retention=retention,
            metrics=metrics,
            hash_invalid_keys=hash_invalid_keys,
            command_timeout=command_timeout,
            cache=cache,
            pooler=pooler,
        )

    async def open(self) -> PostgresStore:
        """Open the pool of a store made with :meth:`from_dsn` now (a store given a pool has
        nothing to open): an unreachable database fails the start-up, not the first message."""
        if isinstance(self.pool, DsnPool):
            await self.pool.open()
        return self

    async def close(self) -> None:
        """Close the pool of a store made with :meth:`from_dsn`; a pool you passed in is
        yours to close, and stays open."""
        if isinstance(self.pool, DsnPool):
            await self.pool.close()

    async def __aenter__(self) -> PostgresStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- plumbing ------------------------------------------------------------------------------

    @asynccontextmanager
    async def connection(self, conn: asyncpg.Connection | None = None) -> AsyncIterator[Any]:
        """Yield ``conn`` itself, or a pooled connection; pool failures become StoreUnavailable."""
        if conn is not None:
            yield conn
            return
        try:
            acquired = self.pool.acquire(timeout=self.command_timeout)
            connection = await acquired.__aenter__()
        except Exception as exc:
            raise self.error_for("acquire", exc) from exc
        try:
            yield connection
        finally:
            try:
                await acquired.__aexit__(None, None, None)
            except Exception:  # releasing a broken connection must not mask the real error
                log.debug("releasing a connection failed", exc_info=True)

    def error_for(
        self, operation: str, exc: BaseException, scope: str = "", conn: Any = None
    ) -> ConsumerIdemError:
        """The library error for a failed store operation: :class:`StoreUnavailable` for an
        outage, :class:`SchemaMissing` or :class:`StoreRejected` for what the data caused
        (see ``pg_errors``). ``conn``: the connection it failed on, closed when the server
        cannot take writes (see :class:`WrongNode`)."""
        kind = pg_errors.kind_of(exc)
        self.metrics.inc("store_error", scope)
        wrong_node = pg_errors.wrong_node(exc)
        if wrong_node:  # said once per episode, not once per message
            self.wrong_node.seen(exc, conn)
        log.log(
            logging.DEBUG if wrong_node else logging.WARNING,
            "store %s failed (%s): %s: %s",
            operation,
            kind.__name__,
            type(exc).__name__,
            exc,
            extra={"scope": scope, "operation": operation},
        )
        error = kind(pg_errors.describe(operation, exc))
        if wrong_node and isinstance(error, StoreUnavailable):
            error.said = True
        return error

    @staticmethod
    def is_outage(exc: BaseException) -> bool:
        """Is ``exc`` (raised by the database driver) an outage that waiting may cure?"""
        return pg_errors.kind_of(exc) is StoreUnavailable

    async def run(
        self,
        operation: str,
        scope: str,
        conn: asyncpg.Connection | None,
        call: Callable[[Any], Awaitable[T]],
    ) -> T:
        """Run ``call`` on ``conn`` or a pooled connection, timed, with every database failure
        turned into the library's error for it (the store's parts all go through here)."""
        started = time.perf_counter()
        c: Any = None
        try:
            async with self.connection(conn) as c:
                return await call(c)
        except ConsumerIdemError:
            raise
        except Exception as exc:  # any database failure means: do not proceed
            error = self.error_for(operation, exc, scope, c)
            if isinstance(error, StoreRejected) and await self.refuses_any_write():
                # the same class also says "the server takes no write at all" (54000: its
                # XID wraparound protection): then the message is not to blame; wait
                error = StoreUnavailable(
                    f"{error}; the database refuses a write that carries no message data "
                    "too: an outage of the server (XID wraparound protection? run VACUUM), "
                    "not the message's data"
                )
            raise error from exc
        finally:
            self.metrics.observe(operation, time.perf_counter() - started)

    async def refuses_any_write(self) -> bool:
        """Before the message is blamed for a refusal: does the server refuse a write that
        carries none of its data (an empty transaction that takes a transaction ID)? Only a
        refusal by the server says so; no free connection to ask on says nothing."""
        try:
            async with self.pool.acquire(timeout=_PROBE_ACQUIRE_S) as probe:
                await probe.execute(
                    "BEGIN; SELECT pg_current_xact_id(); ROLLBACK", timeout=self.command_timeout
                )
        except asyncpg.PostgresError:
            return True
        except Exception:  # no connection to ask on (a full pool): keep the data's verdict
            log.debug("asking whether the server takes writes failed", exc_info=True)
        return False

    # --- schema --------------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Create or upgrade the schema; safe when several processes run it at once (one
        transaction: it goes through a transaction pooler too)."""

        async def apply(c: Any) -> list[int]:
            await self._check_pool(c)
            return await migrate.apply(c, self.schema)

        return await self.run("migrate", "", None, apply)

    async def _check_pool(self, conn: Any) -> None:
        if self.pooler == "transaction":
            await check_pool(conn)

    async def check_schema(self) -> None:
        """Fail fast at start-up: raise :class:`SchemaMissing` (naming the command that fixes it)
        when the schema is missing or older than this library, :class:`StoreUnavailable` when
        the database cannot be reached. Runners call it before consuming."""
        wanted = max(m.version for m in migrate.available())
        sql = f'SELECT coalesce(max(version), 0) FROM "{self.schema}".schema_migrations'

        async def check(c: Any) -> int:
            await self._check_pool(c)
            found: int = await c.fetchval(sql)
            return found

        version = await self.run("check_schema", "", None, check)
        if version < wanted:
            raise SchemaMissing(
                f"the idempotency schema {self.schema!r} is at version {version}, this library "
                f"needs {wanted}: {pg_errors.MIGRATE_HINT}"
            )

    # --- reservation ---------------------------------------------------------------------------

    async def reserve(
        self,
        scope: str,
        key: str | bytes,
        fingerprint: str,
        *,
        lease: timedelta | float | None = None,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Decision:
        """Decide what this delivery may do (see :class:`DecisionKind`)."""
        scope, key = self.check(scope, key)
        cached = await self.cached_decision(scope, key, fingerprint)
        if cached is not None:
            return cached
        token = uuid.uuid4()
        lease_td = self.lease if lease is None else checked_duration(lease, "lease")
        retention_td = self.retention_for(scope, retention)

        async def call(c: Any) -> Any:
            return await c.fetchrow(
                self._reserve_sql,
                scope,
                key,
                fingerprint,
                token,
                lease_td,
                retention_td,
                timeout=self.command_timeout,
            )

        row = await self.run("reserve", scope, conn, call)
        decision = Decision(
            DecisionKind(row["decision"]), Record.from_row(row["rec"]), row["zombie"]
        )
        self.count_decision(decision, scope)
        if decision.kind is DecisionKind.REPLAY:
            await self.remember(decision.record)  # committed and immutable: safe to cache
        if decision.zombie:
            log.warning(
                "scope=%s key=%s: lease expired with no word from its owner; parked as unknown "
                "for reconciliation",
                scope,
                key,
                extra={"scope": scope, "key": key},
            )
        log.debug(
            "scope=%s key=%s: reserve -> %s",
            scope,
            key,
            decision.kind,
            extra={"scope": scope, "key": key},
        )
        return decision

    # --- the completed-record cache ------------------------------------------------------------

    async def cached_decision(self, scope: str, key: str, fingerprint: str) -> Decision | None:
        """A replay (or misuse) answered from the cache, or None: ask Postgres."""
        if self.cache is None:
            return None
        record = await self.cache.get(scope, key)
        if record is None:
            return None
        if record.fingerprint != fingerprint:
            self.metrics.inc("key_misuse", scope)
            return Decision(DecisionKind.MISUSE, record)
        self.metrics.inc("replay", scope)
        return Decision(DecisionKind.REPLAY, record)

    async def remember(self, record: Record | None) -> None:
        """Cache a record completed and committed (no-op without a cache)."""
        if self.cache is not None and record is not None:
            await self.cache.put(record)

    # --- transactional fast path ---------------------------------------------------------------

    # --- owner transitions (fenced by the token) ----------------------------------------------

    async def _owner_update(
        self,
        operation: str,
        scope: str,
        key: str,
        token: uuid.UUID,
        assignments: str,
        args: tuple[Any, ...],
        conn: asyncpg.Connection | None,
    ) -> Record:
        # The token alone says "in progress" (the table's CHECK ties one to the other): a
        # status condition here would let the planner take a partial index for the primary
        # key, and walk it whole (migration 8)
        sql = (
            f"UPDATE {self.table} SET {assignments}, owner_token = NULL, locked_until = NULL,"
            " updated_at = now()"
            " WHERE scope = $1 AND key = $2 AND owner_token = $3"
            " RETURNING *"
        )

        async def call(c: Any) -> Any:
            return await c.fetchrow(sql, scope, key, token, *args, timeout=self.command_timeout)

        row = await self.run(operation, scope, conn, call)
        if row is None:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(
                f"{operation}: ({scope!r}, {key!r}) is no longer held by this owner "
                "(lease expired and the record was taken over, resolved or evicted)"
            )
        return Record.from_row(row)

    async def complete(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        response: StoredResponse | None = None,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Record:
        """Store the result and mark the record ``completed``. Pass ``conn`` to commit it with
        your own writes. Raises :class:`LeaseLost` when this owner no longer holds the record."""
        retention_td = self.retention_for(scope, retention)
        record = await self._owner_update(
            "complete",
            scope,
            key,
            token,
            "status = 'completed', result = $4::json, result_kind = $5, http_status = $6,"
            " http_headers = $7::jsonb, http_body = $8, last_error = NULL, completed_at = now(),"
            " expires_at = now() + $9::interval",
            (
                encode_result(result),
                result_kind.value,
                response.status if response else None,
                json.dumps(dict(response.headers)) if response else None,
                response.body if response else None,
                retention_td,
            ),
            conn,
        )
        if conn is None:  # committed already; inside a caller's transaction it is not yet
            await self.remember(record)
        return record

    async def fail_retryable(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        error: str = "retryable",
        *,
        conn: asyncpg.Connection | None = None,
    ) -> Record:
        """The work provably did not happen: the next delivery may re-acquire the key."""
        record = await self._owner_update(
            "fail_retryable",
            scope,
            key,
            token,
            "status = 'failed_retryable', last_error = $4",
            (error,),
            conn,
        )
        self.metrics.inc("failed_retry", scope)
        return record

    async def mark_unknown(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        error: str = "ambiguous",
        *,
        conn: asyncpg.Connection | None = None,
    ) -> Record:
        """The work may have happened: park the record for reconciliation."""
        record = await self._owner_update(
            "mark_unknown",
            scope,
            key,
            token,
            "status = 'unknown', last_error = $4, reconcile_after = now(),"
            " reconcile_published_at = NULL",
            (error,),
            conn,
        )
        self.metrics.inc("unknown", scope)
        log.warning(
            "scope=%s key=%s: parked as unknown for reconciliation: %s",
            scope,
            key,
            error,
            extra={"scope": scope, "key": key},
        )
        return record

    # --- reconciliation ------------------------------------------------------------------------

    async def resolve(
        self,
        scope: str,
        key: str,
        resolution: Resolution,
        *,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Record:
        """Settle an ``unknown`` record (the reconciliation path only): ``Executed`` ->
        ``completed`` with its result, ``NotExecuted`` -> ``failed_retryable``.
        Raises :class:`NotUnknown` if the record is not ``unknown``.

        The original message kept for the record (:meth:`keep_original`) is settled in the same
        transaction: deleted on ``Executed``; on ``NotExecuted`` armed, due now, so the sweeper
        re-dispatches it (its delivery was acked: nothing else would run it again)."""
        record, _ = await self.reconciliation.settle(
            scope, key, resolution, retention=retention, conn=conn
        )
        return record

    # --- operators -----------------------------------------------------------------------------

    async def get(self, scope: str, key: str) -> Record | None:
        async def call(c: Any) -> Any:
            return await c.fetchrow(
                f"SELECT * FROM {self.table} WHERE scope = $1 AND key = $2",
                scope,
                key,
                timeout=self.command_timeout,
            )

        row = await self.run("get", scope, None, call)
        return None if row is None else Record.from_row(row)

    async def evict(self, scope: str, key: str, *, token: uuid.UUID | None = None) -> bool:
        """Delete a record. With ``token``, only while that owner still holds it (an owner
        cleaning up after itself); without, as an operator (:meth:`evict_record`): False when
        there is no record, :class:`KeyHeld` when a worker holds it (nothing evicted)."""
        if token is None:
            eviction = await self.evict_record(scope, key)
            if eviction is not None and eviction.held_until is not None:
                raise KeyHeld(scope, key, eviction.held_until)
            return eviction is not None
        sql = f"DELETE FROM {self.table} WHERE scope = $1 AND key = $2 AND owner_token = $3"

        async def call(c: Any) -> Any:
            return await c.execute(sql, scope, key, token, timeout=self.command_timeout)

        tag: str = await self._uncached("evict", scope, key, call)
        deleted = tag.endswith(" 1")
        if not deleted:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"evict: ({scope!r}, {key!r}) is no longer held by this owner")
        return deleted

    async def evict_record(
        self, scope: str, key: str, *, while_held: bool = False
    ) -> Eviction | None:
        """An operator's evict: delete the record, so its key is new work. None: no record.

        A record a worker holds (``in_progress``, its lease not run out) is left as it is
        (``Eviction.held_until`` says until when) unless ``while_held``: deleted under a
        running call, a duplicate delivered before that call ends would run it again.

        The key's work is never lost with it. An ``unknown`` or ``failed_retryable`` record
        may be the only thing standing for a delivery that was acked (its original kept, or
        armed by a "not executed" answer): that original is armed, due now, in the same
        transaction, and the sweeper sends it again (``Eviction.redispatch_to``). For any
        other status a leftover outbox row is stale and goes with the record."""

        async def call(c: Any) -> Eviction | None:
            # Two statements in one transaction: the DELETE waits for a keep_original holding
            # the row (FOR SHARE), and the outbox statement then sees what it kept (one
            # statement's snapshot would predate the wait and orphan the kept original).
            await c.execute("BEGIN")
            try:
                status = await c.fetchval(
                    f"DELETE FROM {self.table} WHERE scope = $1 AND key = $2 AND ($3"
                    " OR status <> 'in_progress' OR locked_until <= clock_timestamp())"
                    " RETURNING status",
                    scope,
                    key,
                    while_held,
                    timeout=self.command_timeout,
                )
                eviction = None
                if status is not None:
                    source = await self.redispatch.after_evict(c, scope, key, Status(status))
                    eviction = Eviction(scope, key, Status(status), source)
                else:
                    held = await c.fetchval(
                        f"SELECT locked_until FROM {self.table} WHERE scope = $1 AND key = $2"
                        " AND status = 'in_progress'",
                        scope,
                        key,
                        timeout=self.command_timeout,
                    )
                    if held is not None:
                        eviction = Eviction(scope, key, Status.IN_PROGRESS, held_until=held)
                await commit(c)
            except BaseException:
                await rollback(c)
                raise
            return eviction

        eviction = await self._uncached("evict", scope, key, call)
        if eviction is not None and eviction.evicted:
            log.warning(
                "scope=%s key=%s: evicted by an operator (was %s)%s",
                scope,
                key,
                eviction.status,
                ""
                if eviction.redispatch_to is None
                else f"; its original is armed for re-dispatch to {eviction.redispatch_to}",
                extra={"scope": scope, "key": key},
            )
        return eviction

    async def _uncached(
        self, operation: str, scope: str, key: str, call: Callable[[Any], Awaitable[T]]
    ) -> T:
        """Run a delete of a record with its cache entry dropped before and after (fenced: a
        read racing the delete cannot re-cache it)."""
        if self.cache is not None:
            await self.cache.delete([(scope, key)])
        result = await self.run(operation, scope, None, call)
        if self.cache is not None:
            await self.cache.delete([(scope, key)])
        return result
