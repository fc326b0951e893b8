"""The PostgreSQL idempotency store: reservations and every state transition.

Every write after a reservation is conditional on the owner token (fencing), and every database
failure surfaces as a library error so that no caller proceeds unprotected: an outage as
[`StoreUnavailable`][consumer_idem.StoreUnavailable] (wait it out), a missing schema as
[`SchemaMissing`][consumer_idem.SchemaMissing], and only
what the message's data caused as [`StoreRejected`][consumer_idem.StoreRejected] (see
``pg_errors``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import asyncpg

from consumer_idem.errors import (
    ConsumerIdemError,
    LeaseLost,
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
from consumer_idem.stores.postgres.cached_decisions import CachedDecisions
from consumer_idem.stores.postgres.connections import Connections
from consumer_idem.stores.postgres.dsn_pool import DsnPool
from consumer_idem.stores.postgres.eviction import Evictions
from consumer_idem.stores.postgres.fast_path import FastPath
from consumer_idem.stores.postgres.maintenance import Maintenance
from consumer_idem.stores.postgres.outbox import Outbox
from consumer_idem.stores.postgres.pooler import Pooler, validate_pooler
from consumer_idem.stores.postgres.reconciliation import Reconciliation
from consumer_idem.stores.postgres.redispatch import RedispatchOutbox
from consumer_idem.stores.postgres.schema_version import SchemaVersion
from consumer_idem.stores.postgres.wrong_node import WrongNode
from consumer_idem.stores.results import encode_result
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Eviction,
    Record,
    Resolution,
    ResultKind,
    StoredResponse,
)

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
    are parts of their own: ``fast_path`` (`FastPath`, the claim engine's transactional
    path), ``reconciliation`` (`Reconciliation`), ``redispatch``
    (`RedispatchOutbox`, the originals kept for ``unknown`` records), ``outbox``
    (`Outbox`, the transactional outbox: messages handlers publish through
    ``outbox_for(conn)``) and ``maintenance`` (`Maintenance`: sweep, prune, stats and the
    key listing, with typed reports).

    ``pooler="transaction"``: the pool reaches PostgreSQL through a transaction pooler
    (PgBouncer ``pool_mode=transaction``, most managed providers' pooled ports); create it with
    ``statement_cache_size=0`` ([`create_pool`][consumer_idem.stores.postgres.pooler.create_pool]).
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
        self._connections = Connections(self)
        self._schema_version = SchemaVersion(self)
        self._evictions = Evictions(self)
        self._cached = CachedDecisions(self)
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
        **pool_options)``, see `DsnPool`) opens on first use, or when you await
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
        """Open the pool of a store made with `from_dsn` now (a store given a pool has
        nothing to open): an unreachable database fails the start-up, not the first message."""
        if isinstance(self.pool, DsnPool):
            await self.pool.open()
        return self

    async def close(self) -> None:
        """Close the pool of a store made with `from_dsn`; a pool you passed in is
        yours to close, and stays open."""
        if isinstance(self.pool, DsnPool):
            await self.pool.close()

    async def __aenter__(self) -> PostgresStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- plumbing ------------------------------------------------------------------------------

    def connection(
        self, conn: asyncpg.Connection | None = None
    ) -> AbstractAsyncContextManager[Any]:
        """Yield ``conn`` itself, or a pooled connection; pool failures become StoreUnavailable."""
        return self._connections.connection(conn)

    def error_for(
        self, operation: str, exc: BaseException, scope: str = "", conn: Any = None
    ) -> ConsumerIdemError:
        """The library error for a failed store operation:
        [`StoreUnavailable`][consumer_idem.StoreUnavailable] for an
        outage, [`SchemaMissing`][consumer_idem.SchemaMissing] or
        [`StoreRejected`][consumer_idem.StoreRejected] for what the data caused
        (see ``pg_errors``). ``conn``: the connection it failed on, closed when the server
        cannot take writes (see `WrongNode`)."""
        return self._connections.error_for(operation, exc, scope, conn)

    @staticmethod
    def is_outage(exc: BaseException) -> bool:
        """Is ``exc`` (raised by the database driver) an outage that waiting may cure?"""
        return pg_errors.kind_of(exc) is StoreUnavailable

    def run(
        self,
        operation: str,
        scope: str,
        conn: asyncpg.Connection | None,
        call: Callable[[Any], Awaitable[T]],
    ) -> Coroutine[Any, Any, T]:
        """Run ``call`` on ``conn`` or a pooled connection, timed, with every database failure
        turned into the library's error for it (the store's parts all go through here)."""
        return self._connections.run(operation, scope, conn, call)

    async def refuses_any_write(self) -> bool:
        """Before the message is blamed for a refusal: does the server refuse a write that
        carries none of its data (an empty transaction that takes a transaction ID)? Only a
        refusal by the server says so; no free connection to ask on says nothing."""
        return await self._connections.refuses_any_write()

    # --- schema --------------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Create or upgrade the schema; safe when several processes run it at once (one
        transaction: it goes through a transaction pooler too)."""
        return await self._schema_version.migrate()

    async def check_schema(self) -> None:
        """Fail fast at start-up: raise [`SchemaMissing`][consumer_idem.SchemaMissing] (naming the
        command that fixes it)
        when the schema is missing or older than this library,
        [`StoreUnavailable`][consumer_idem.StoreUnavailable] when
        the database cannot be reached. Runners call it before consuming."""
        await self._schema_version.check()

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
        """Decide what this delivery may do (see [`DecisionKind`][consumer_idem.DecisionKind])."""
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

    def cached_decision(
        self, scope: str, key: str, fingerprint: str
    ) -> Coroutine[Any, Any, Decision | None]:
        """A replay (or misuse) answered from the cache, or None: ask Postgres."""
        return self._cached.decision(scope, key, fingerprint)

    def remember(self, record: Record | None) -> Coroutine[Any, Any, None]:
        """Cache a record completed and committed (no-op without a cache)."""
        return self._cached.remember(record)

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
        your own writes. Raises [`LeaseLost`][consumer_idem.LeaseLost] when this owner no longer
        holds the record."""
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
        Raises [`NotUnknown`][consumer_idem.NotUnknown] if the record is not ``unknown``.

        The original message kept for the record (`keep_original`) is settled in the same
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
        cleaning up after itself); without, as an operator (`evict_record`): False when
        there is no record, [`KeyHeld`][consumer_idem.KeyHeld] when a worker holds it (nothing
        evicted)."""
        return await self._evictions.evict(scope, key, token=token)

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
        return await self._evictions.evict_record(scope, key, while_held=while_held)
