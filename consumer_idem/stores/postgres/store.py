"""The PostgreSQL idempotency store: reservations and every state transition.

Every write after a reservation is conditional on the owner token (fencing), and every database
failure surfaces as a library error so that no caller proceeds unprotected: an outage as
:class:`StoreUnavailable` (wait it out), a missing schema as :class:`SchemaMissing`, data the
database refuses as :class:`StoreRejected` (see ``pg_errors``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

import asyncpg

from consumer_idem.commit import check_sql, commit, execute_and_commit, mark_sql, rollback
from consumer_idem.errors import (
    ConsumerIdemError,
    KeyInFlight,
    LeaseLost,
    NotUnknown,
    SchemaMissing,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.keys import normalize_key, validate_scope
from consumer_idem.metrics import Metrics
from consumer_idem.notice import Notice, PendingRedispatch, clean_properties
from consumer_idem.stores.cache import CompletedCache
from consumer_idem.stores.postgres import errors as pg_errors
from consumer_idem.stores.postgres import migrate
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Record,
    ResultKind,
    Status,
    StoredResponse,
)

log = logging.getLogger("consumer_idem.stores.postgres.store")

T = TypeVar("T")

DEFAULT_LEASE = timedelta(seconds=30)
#: consumer scopes: longer than any broker retry or DLQ replay horizon
DEFAULT_RETENTION = timedelta(days=7)
#: HTTP scopes (``http:...``): clients retry a POST for minutes or hours, not days
HTTP_RETENTION = timedelta(hours=24)
HTTP_SCOPE_PREFIX = "http:"


def default_retention(scope: str) -> timedelta:
    """7 days for consumer scopes, 24 hours for HTTP scopes (``http:`` prefix). Webhook scopes
    should outlive the provider's retry horizon: pass your own policy for them."""
    return HTTP_RETENTION if scope.startswith(HTTP_SCOPE_PREFIX) else DEFAULT_RETENTION


_DECISION_COUNTER = {
    DecisionKind.EXECUTE: "created",
    DecisionKind.REPLAY: "replay",
    DecisionKind.IN_PROGRESS: "in_progress",
    DecisionKind.MISUSE: "key_misuse",
    DecisionKind.UNKNOWN: "unknown",
}


@dataclass
class PruneReport:
    rows: int = 0  #: deleted or soft-expired
    batches: int = 0
    longest_statement_s: float = 0.0  #: the longest single batch statement (its lock time)


class PrunePolicy(StrEnum):
    DELETE = "delete"  #: expired rows are deleted
    SOFT = "soft"  #: expired rows become ``expired`` (kept for audit), and are deleted later


@dataclass(frozen=True, slots=True)
class Executed:
    """Reconciliation answer: the work did happen; store this result."""

    result: Any = None
    result_kind: ResultKind = ResultKind.SUCCESS
    response: StoredResponse | None = None


@dataclass(frozen=True, slots=True)
class NotExecuted:
    """Reconciliation answer: the work provably did not happen; it may run again."""

    reason: str = "reconciled: not executed"


Resolution = Executed | NotExecuted


def encode_result(result: Any) -> str | None:
    """Results are stored as JSON text; ``None`` stays SQL NULL."""
    if result is None:
        return None
    try:
        text = json.dumps(result, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnstorableResult(f"handler result must be JSON-serialisable: {exc}") from exc
    try:  # a lone surrogate passes json.dumps but neither UTF-8 nor PostgreSQL's json
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnstorableResult(f"handler result is not valid Unicode: {exc}") from exc
    return text


def _seconds(value: timedelta | float) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def dollar_quote(text: str) -> str:
    """A SQL literal for ``text`` with a dollar-quote tag that does not occur in it.

    Only for the transactional fast path, which sends BEGIN+claim and result+COMMIT as one
    simple-protocol query each (simple queries carry no parameters). Dollar quoting has no
    escapes; excluding ``$tag`` from the text means no closing tag can form inside or across it.
    Keys and scopes never hold NUL (key hygiene rejects control characters) and JSON escapes it.
    """
    tag = "ci"
    while "$" + tag in text:  # rare: only then pay for a random tag
        tag = "ci" + secrets.token_hex(4)
    return f"${tag}${text}${tag}$"


class PostgresStore:
    """Idempotency records in PostgreSQL, one row per (scope, key).

    ``pool`` is an asyncpg pool; the store never closes it. Methods taking ``conn`` run on that
    connection (inside the caller's transaction) instead of a pooled one, so the caller's own
    writes and the store's transition commit together.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = "consumer_idem",
        lease: timedelta | float = DEFAULT_LEASE,
        retention: timedelta | float | Callable[[str], timedelta] | None = None,
        metrics: Metrics | None = None,
        hash_invalid_keys: bool = False,
        command_timeout: float = 30.0,
        cache: CompletedCache | None = None,
    ) -> None:
        self.pool = pool
        #: optional Redis cache of completed records (Postgres stays the authority)
        self.cache = cache
        self.schema = migrate.validate_schema(schema)
        self.lease = _seconds(lease)
        if retention is None:
            self._retention: Callable[[str], timedelta] = default_retention
        elif callable(retention):
            self._retention = retention
        else:
            fixed = _seconds(retention)
            self._retention = lambda scope: fixed
        self.metrics = metrics or Metrics()
        if cache is not None:
            cache.metrics = self.metrics  # one set of counters per store
        self.hash_invalid_keys = hash_invalid_keys
        self.command_timeout = command_timeout
        self.last_prune = PruneReport()
        self.table = f'"{self.schema}".idempotency_records'
        self._claim_stmt = f"consumer_idem_claim_{self.schema}"
        self._result_stmt = f"consumer_idem_result_{self.schema}"
        self._reserve_sql = (
            f'SELECT decision, zombie, rec FROM "{self.schema}".reserve($1, $2, $3, $4, $5, $6)'
        )

    def retention_for(self, scope: str, override: timedelta | float | None = None) -> timedelta:
        """How long a record of ``scope`` is kept after it was last written."""
        return self._retention(scope) if override is None else _seconds(override)

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

    def error_for(self, operation: str, exc: BaseException, scope: str = "") -> ConsumerIdemError:
        """The library error for a failed store operation: :class:`StoreUnavailable` for an
        outage, :class:`SchemaMissing` or :class:`StoreRejected` for what waiting cannot fix."""
        kind = pg_errors.kind_of(exc)
        self.metrics.inc("store_error", scope)
        log.warning(
            "store %s failed (%s): %s: %s",
            operation,
            kind.__name__,
            type(exc).__name__,
            exc,
            extra={"scope": scope, "operation": operation},
        )
        return kind(pg_errors.describe(operation, exc))

    @staticmethod
    def is_outage(exc: BaseException) -> bool:
        """Is ``exc`` (raised by the database driver) an outage that waiting may cure?"""
        return pg_errors.kind_of(exc) is StoreUnavailable

    async def _run(
        self,
        operation: str,
        scope: str,
        conn: asyncpg.Connection | None,
        call: Callable[[Any], Awaitable[T]],
    ) -> T:
        started = time.perf_counter()
        try:
            async with self.connection(conn) as c:
                return await call(c)
        except ConsumerIdemError:
            raise
        except Exception as exc:  # any database failure means: do not proceed
            raise self.error_for(operation, exc, scope) from exc
        finally:
            self.metrics.observe(operation, time.perf_counter() - started)

    def check(self, scope: str, key: str | bytes) -> tuple[str, str]:
        """Validate scope and key (raises InvalidKey); returns them as stored."""
        return validate_scope(scope), normalize_key(key, hash_invalid=self.hash_invalid_keys)

    # --- schema --------------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Create or upgrade the schema; safe when several processes run it at once."""
        return await self._run("migrate", "", None, lambda c: migrate.apply(c, self.schema))

    async def check_schema(self) -> None:
        """Fail fast at start-up: raise :class:`SchemaMissing` (naming the command that fixes it)
        when the schema is missing or older than this library, :class:`StoreUnavailable` when
        the database cannot be reached. Runners call it before consuming."""
        wanted = max(m.version for m in migrate.available())
        sql = f'SELECT coalesce(max(version), 0) FROM "{self.schema}".schema_migrations'
        version = await self._run("check_schema", "", None, lambda c: c.fetchval(sql))
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
        lease_td = self.lease if lease is None else _seconds(lease)
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

        row = await self._run("reserve", scope, conn, call)
        decision = Decision(
            DecisionKind(row["decision"]), Record.from_row(row["rec"]), row["zombie"]
        )
        self.metrics.inc(_DECISION_COUNTER[decision.kind], scope)
        if decision.kind is DecisionKind.REPLAY:
            await self.remember(decision.record)  # committed and immutable: safe to cache
        if decision.zombie:
            self.metrics.inc("zombie", scope)
            log.warning("lease expired: parked as unknown", extra={"scope": scope, "key": key})
        log.debug("reserve -> %s", decision.kind, extra={"scope": scope, "key": key})
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

    def completed_record(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        encoded: str | None,
        retention: timedelta | float | None = None,
    ) -> Record:
        """The record the transactional fast path committed, without reading it back."""
        now = datetime.now(UTC)
        return Record(
            scope=scope,
            key=key,
            fingerprint=fingerprint,
            status=Status.COMPLETED,
            owner_token=None,
            locked_until=None,
            attempts=1,
            result_json=encoded,
            result_kind=ResultKind.SUCCESS,
            response=None,
            last_error=None,
            reconcile_after=None,
            reconcile_attempts=0,
            reconcile_published_at=None,
            created_at=now,
            updated_at=now,
            completed_at=now,
            expires_at=now + self.retention_for(scope, retention),
        )

    async def remember(self, record: Record | None) -> None:
        """Cache a record completed and committed (no-op without a cache)."""
        if self.cache is not None and record is not None:
            await self.cache.put(record)

    # --- transactional fast path ---------------------------------------------------------------

    def _fast_path_statements(self) -> dict[str, str]:
        # Server-side prepared statements: the fast path sends simple-protocol queries (to batch
        # BEGIN/COMMIT with a statement), and those would otherwise be planned on every call.
        return {
            self._claim_stmt: (
                f"PREPARE {self._claim_stmt}(text, text, text, float8) AS"
                f" INSERT INTO {self.table} (scope, key, fingerprint, status, result_kind,"
                " completed_at, expires_at) VALUES ($1, $2, $3, 'completed', 'success', now(),"
                " now() + make_interval(secs => $4)) ON CONFLICT (scope, key) DO NOTHING"
            ),
            self._result_stmt: (
                f"PREPARE {self._result_stmt}(text, text, text) AS"
                f" UPDATE {self.table} SET result = $3::json WHERE scope = $1 AND key = $2"
            ),
        }

    async def _prepare_fast_path(self, conn: asyncpg.Connection) -> None:
        statements = self._fast_path_statements()
        existing = {
            r["name"]
            for r in await conn.fetch(
                "SELECT name FROM pg_prepared_statements WHERE name = ANY($1::text[])",
                list(statements),
            )
        }
        for name, sql in statements.items():
            if name not in existing:
                await conn.execute(sql)

    async def begin_and_claim(
        self,
        conn: asyncpg.Connection,
        scope: str,
        key: str,
        fingerprint: str,
        retention: timedelta | float | None = None,
        lock_timeout_ms: int | None = None,
        mark: str | None = None,
    ) -> bool:
        """BEGIN a transaction on ``conn`` and claim (scope, key) in the same round trip.
        ``mark``: a :func:`~consumer_idem.commit.new_mark` the transaction carries, so its
        COMMIT can check it is still the same transaction.

        The claim row is written as ``completed`` straight away: nobody can see it before this
        transaction commits (a duplicate blocks on the unique index until then), and if the
        transaction rolls back it never existed. Returns False when a row already exists; the
        transaction stays open and the caller falls back to :meth:`reserve` on ``conn``.

        With ``lock_timeout_ms``, a duplicate does not wait longer than that for the first
        claim's transaction: it raises :class:`KeyInFlight` (the transaction is then aborted;
        roll it back). HTTP uses this to answer 409 instead of holding a connection.
        """
        retention_s = self.retention_for(scope, retention).total_seconds()
        timeout = (
            "" if lock_timeout_ms is None else f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}; "
        )
        marked = "" if mark is None else f"{mark_sql(mark)}; "
        sql = (
            f"BEGIN; {marked}{timeout}EXECUTE {self._claim_stmt}({dollar_quote(scope)},"
            f" {dollar_quote(key)}, {dollar_quote(fingerprint)}, {retention_s!r})"
        )

        async def claim(c: Any) -> str:
            try:
                status: str = await c.execute(sql)
            except asyncpg.InvalidSQLStatementNameError:
                # first use on this connection (or someone ran DEALLOCATE): prepare, retry
                if c.is_in_transaction():
                    await c.execute("ROLLBACK")
                await self._prepare_fast_path(c)
                status = await c.execute(sql)
            return status

        async def call(c: Any) -> str:
            try:
                return await claim(c)
            except asyncpg.LockNotAvailableError as exc:
                raise KeyInFlight(f"({scope!r}, {key!r}) is being claimed right now") from exc

        status = await self._run("claim", scope, conn, call)
        claimed = status == "INSERT 0 1"
        if claimed:
            self.metrics.inc("created", scope)
        return claimed

    async def commit_claimed(
        self, conn: asyncpg.Connection, scope: str, key: str, encoded: str | None
    ) -> None:
        """Store the handler's result (``encode_result`` of it) on a row claimed by
        :meth:`begin_and_claim` and COMMIT, in one round trip. Errors propagate as raised
        (the caller classifies them)."""
        if encoded is None:
            await conn.execute("COMMIT")
            return
        await conn.execute(
            f"EXECUTE {self._result_stmt}({dollar_quote(scope)}, {dollar_quote(key)},"
            f" {dollar_quote(encoded)}); COMMIT"
        )

    async def finish_claimed(
        self,
        conn: asyncpg.Connection,
        scope: str,
        key: str,
        *,
        encoded: str | None = None,
        response: StoredResponse | None = None,
        then: str = "",
        mark: str | None = None,
    ) -> None:
        """Store the result (``encode_result`` of it) and/or an HTTP response on a row claimed by
        :meth:`begin_and_claim`, run ``then`` (a statement of the library's own, e.g. a NOTIFY)
        and COMMIT, in one round trip, checking the commit's tag: raises
        :class:`~consumer_idem.errors.CommitRolledBack` when the transaction had been aborted.
        Other errors propagate as raised (the caller classifies them)."""
        statements = [] if mark is None else [check_sql(mark)]
        where = f" WHERE scope = {dollar_quote(scope)} AND key = {dollar_quote(key)}"
        if response is not None:
            # literals, not parameters: a simple query can carry the COMMIT in the same round
            # trip (the body as hex, so no byte needs escaping)
            result = "" if encoded is None else f"result = {dollar_quote(encoded)}::json, "
            statements.append(
                f"UPDATE {self.table} SET {result}http_status = {int(response.status)},"
                f" http_headers = {dollar_quote(json.dumps(dict(response.headers)))}::jsonb,"
                f" http_body = decode('{response.body.hex()}', 'hex'){where}"
            )
        elif encoded is not None:
            statements.append(
                f"EXECUTE {self._result_stmt}({dollar_quote(scope)}, {dollar_quote(key)},"
                f" {dollar_quote(encoded)})"
            )
        if then:
            statements.append(then)
        if statements:
            await execute_and_commit(conn, "; ".join(statements))
        else:
            await commit(conn)

    async def claim_many(
        self,
        conn: asyncpg.Connection,
        scope: str,
        keys: list[str],
        fingerprints: list[str],
        retention: timedelta | float | None = None,
    ) -> set[str]:
        """Batch mode: claim many new keys with one statement, inside the caller's transaction.
        Rows are written as ``completed`` (invisible until COMMIT, gone on rollback). Returns the
        keys claimed; the others already have a row and go through :meth:`reserve`."""
        retention_td = self.retention_for(scope, retention)
        sql = (
            f"INSERT INTO {self.table} (scope, key, fingerprint, status, result_kind,"
            " completed_at, expires_at)"
            " SELECT $1, u.k, u.f, 'completed', 'success', now(), now() + $4::interval"
            " FROM unnest($2::text[], $3::text[]) AS u(k, f)"
            " ON CONFLICT (scope, key) DO NOTHING RETURNING key"
        )
        rows = await self._run(
            "claim_many",
            scope,
            conn,
            lambda c: c.fetch(
                sql, scope, keys, fingerprints, retention_td, timeout=self.command_timeout
            ),
        )
        self.metrics.inc("created", scope, len(rows))
        return {r["key"] for r in rows}

    async def store_results(
        self, conn: asyncpg.Connection, scope: str, keys: list[str], encoded: list[str]
    ) -> None:
        """Batch mode: set the JSON results of rows claimed by :meth:`claim_many`."""
        if not keys:
            return
        sql = (
            f"UPDATE {self.table} t SET result = u.r::json"
            " FROM unnest($2::text[], $3::text[]) AS u(k, r)"
            " WHERE t.scope = $1 AND t.key = u.k"
        )
        await self._run(
            "store_results",
            scope,
            conn,
            lambda c: c.execute(sql, scope, keys, encoded, timeout=self.command_timeout),
        )

    async def mark_reconcile_published(self, scope: str, key: str) -> bool:
        """Record that the reconciliation notice of an ``unknown`` record was published, so the
        sweeper does not publish it again before it is due."""
        sql = (
            f"UPDATE {self.table} SET reconcile_published_at = now()"
            " WHERE scope = $1 AND key = $2 AND status = 'unknown'"
        )
        status: str = await self._run(
            "mark_published",
            scope,
            None,
            lambda c: c.execute(sql, scope, key, timeout=self.command_timeout),
        )
        return status.endswith(" 1")

    async def attach_response(
        self, conn: asyncpg.Connection, scope: str, key: str, response: StoredResponse
    ) -> None:
        """HTTP, transactional fast path: store the response on the row this transaction
        claimed with :meth:`begin_and_claim` (it commits with the endpoint's writes)."""
        sql = (
            f"UPDATE {self.table} SET http_status = $3, http_headers = $4::jsonb, http_body = $5"
            " WHERE scope = $1 AND key = $2"
        )
        await self._run(
            "attach_response",
            scope,
            conn,
            lambda c: c.execute(
                sql,
                scope,
                key,
                response.status,
                json.dumps(dict(response.headers)),
                response.body,
                timeout=self.command_timeout,
            ),
        )

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
        sql = (
            f"UPDATE {self.table} SET {assignments}, owner_token = NULL, locked_until = NULL,"
            " updated_at = now()"
            " WHERE scope = $1 AND key = $2 AND owner_token = $3 AND status = 'in_progress'"
            " RETURNING *"
        )

        async def call(c: Any) -> Any:
            return await c.fetchrow(sql, scope, key, token, *args, timeout=self.command_timeout)

        row = await self._run(operation, scope, conn, call)
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
        log.warning("parked as unknown: %s", error, extra={"scope": scope, "key": key})
        return record

    # --- records written without a prior reservation (transactional mode failure paths) -------

    async def record_failure(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        status: str,
        error: str,
        *,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Record | None:
        """After a rolled-back transactional attempt, remember it as ``failed_retryable`` (with its
        attempt count) or ``unknown``. Leaves an existing record in any other state alone and
        returns ``None`` then (someone else got there first)."""
        retention_td = self.retention_for(scope, retention)
        sql = (
            f"INSERT INTO {self.table} AS t (scope, key, fingerprint, status, last_error,"
            " reconcile_after, expires_at)"
            " VALUES ($1, $2, $3, $4, $5, CASE WHEN $4 = 'unknown' THEN now() END,"
            " now() + $6::interval)"
            " ON CONFLICT (scope, key) DO UPDATE SET status = EXCLUDED.status,"
            " attempts = t.attempts + 1, last_error = EXCLUDED.last_error,"
            " reconcile_after = EXCLUDED.reconcile_after, reconcile_published_at = NULL,"
            " updated_at = now()"
            " WHERE t.status = 'failed_retryable' AND t.fingerprint = EXCLUDED.fingerprint"
            " RETURNING *"
        )

        async def call(c: Any) -> Any:
            return await c.fetchrow(
                sql,
                scope,
                key,
                fingerprint,
                status,
                error,
                retention_td,
                timeout=self.command_timeout,
            )

        row = await self._run("record_failure", scope, conn, call)
        if row is None:
            return None
        self.metrics.inc("unknown" if status == "unknown" else "failed_retry", scope)
        return Record.from_row(row)

    async def complete_new(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        result: Any,
        result_kind: ResultKind,
        *,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Record | None:
        """Store a completed result for a key that has no live record (a deterministic domain
        error whose transaction was rolled back). Returns ``None`` if another record won."""
        retention_td = self.retention_for(scope, retention)
        sql = (
            f"INSERT INTO {self.table} AS t (scope, key, fingerprint, status, result, result_kind,"
            " completed_at, expires_at)"
            " VALUES ($1, $2, $3, 'completed', $4::json, $5, now(), now() + $6::interval)"
            " ON CONFLICT (scope, key) DO UPDATE SET status = 'completed',"
            " result = EXCLUDED.result,"
            " result_kind = EXCLUDED.result_kind, attempts = t.attempts + 1, last_error = NULL,"
            " completed_at = now(), updated_at = now(), expires_at = EXCLUDED.expires_at"
            " WHERE t.status = 'failed_retryable' AND t.fingerprint = EXCLUDED.fingerprint"
            " RETURNING *"
        )

        async def call(c: Any) -> Any:
            return await c.fetchrow(
                sql,
                scope,
                key,
                fingerprint,
                encode_result(result),
                result_kind.value,
                retention_td,
                timeout=self.command_timeout,
            )

        row = await self._run("complete_new", scope, conn, call)
        return None if row is None else Record.from_row(row)

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
        record, _ = await self._resolve(scope, key, resolution, retention=retention, conn=conn)
        return record

    async def _resolve(
        self,
        scope: str,
        key: str,
        resolution: Resolution,
        *,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
        notice: Notice | None = None,
        due_in: timedelta | float = 0.0,
    ) -> tuple[Record, PendingRedispatch | None]:
        """:meth:`resolve`, returning the armed re-dispatch too ("not executed" with an original
        kept, or carried by ``notice``; due after ``due_in``)."""
        retention_td = self.retention_for(scope, retention)
        if isinstance(resolution, Executed):
            response = resolution.response
            sql = (
                f"UPDATE {self.table} SET status = 'completed', result = $3::json,"
                " result_kind = $4, http_status = $5, http_headers = $6::jsonb, http_body = $7,"
                " completed_at = now(), updated_at = now(), expires_at = now() + $8::interval,"
                " reconcile_after = NULL"
                " WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
            )
            args: tuple[Any, ...] = (
                encode_result(resolution.result),
                resolution.result_kind.value,
                response.status if response else None,
                json.dumps(dict(response.headers)) if response else None,
                response.body if response else None,
                retention_td,
            )
        else:
            sql = (
                f"UPDATE {self.table} SET status = 'failed_retryable', last_error = $3,"
                " reconcile_after = NULL, updated_at = now()"
                " WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
            )
            args = (resolution.reason,)

        async def call(c: Any) -> tuple[Any, PendingRedispatch | None]:
            # Two statements in one transaction (ours, or the caller's): the record's UPDATE
            # waits for a keep_original holding the row, and the next statement then sees
            # what it kept. One statement would miss it (its snapshot predates the wait).
            own = not c.is_in_transaction()
            if own:
                await c.execute("BEGIN")
            try:
                row = await c.fetchrow(sql, scope, key, *args, timeout=self.command_timeout)
                entry = None
                if row is not None:
                    entry = await self._settle_original(c, scope, key, resolution, notice, due_in)
                if own:
                    await commit(c)
            except BaseException:
                if own:
                    await rollback(c)
                raise
            return row, entry

        row, entry = await self._run("resolve", scope, conn, call)
        if row is None:
            raise NotUnknown(f"({scope!r}, {key!r}) is not unknown; nothing to resolve")
        self.metrics.inc("reconcile_resolved", scope)
        log.info("resolved unknown -> %s", row["status"], extra={"scope": scope, "key": key})
        record = Record.from_row(row)
        if conn is None:
            await self.remember(record)
        return record, entry

    async def _unknown_update(
        self, operation: str, scope: str, key: str, assignments: str, *args: Any
    ) -> Record:
        sql = (
            f"UPDATE {self.table} SET {assignments}, reconcile_attempts = reconcile_attempts + 1,"
            " updated_at = now() WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
        )
        row = await self._run(
            operation,
            scope,
            None,
            lambda c: c.fetchrow(sql, scope, key, *args, timeout=self.command_timeout),
        )
        if row is None:
            raise NotUnknown(f"({scope!r}, {key!r}) is not unknown")
        return Record.from_row(row)

    async def reschedule(
        self, scope: str, key: str, after: timedelta | float, reason: str
    ) -> Record:
        """Still unknown: ask again after ``after`` (the sweeper re-sends the notice then)."""
        record = await self._unknown_update(
            "reschedule",
            scope,
            key,
            "reconcile_after = now() + $3::interval, last_error = $4",
            _seconds(after),
            reason,
        )
        self.metrics.inc("reconcile_scheduled", scope)
        return record

    async def hand_to_operator(self, scope: str, key: str, reason: str) -> Record:
        """Reconciliation gave up: the record stays ``unknown``, no longer scheduled, for a
        person to settle (``resolve`` still works)."""
        record = await self._unknown_update(
            "hand_to_operator",
            scope,
            key,
            "reconcile_after = NULL, last_error = $3",
            f"operator: {reason}"[:500],
        )
        self.metrics.inc("reconcile_failed", scope)
        log.error(
            "reconciliation exhausted, handed to an operator: %s",
            reason,
            extra={"scope": scope, "key": key},
        )
        return record

    async def due_notices(
        self, limit: int = 100, scopes: Sequence[str] | None = None
    ) -> list[Record]:
        """``unknown`` records whose notification is due: never published (a crash between
        parking and publishing), or rescheduled and due again. The outbox of reconciliation."""
        sql = (
            f"SELECT * FROM {self.table} WHERE status = 'unknown' AND reconcile_after <= now()"
            " AND (reconcile_published_at IS NULL OR reconcile_published_at < reconcile_after)"
            " AND ($2::text[] IS NULL OR scope = ANY($2::text[]))"
            " ORDER BY reconcile_after LIMIT $1"
        )
        wanted = None if scopes is None else list(scopes)
        rows = await self._run(
            "due_notices",
            "",
            None,
            lambda c: c.fetch(sql, limit, wanted, timeout=self.command_timeout),
        )
        return [Record.from_row(r) for r in rows]

    async def stats(self, scope: str | None = None) -> dict[str, Any]:
        """Rows per status per scope, the oldest in-progress and unknown records (seconds) and
        the reconciliation backlog."""
        where = "" if scope is None else "WHERE scope = $1"
        args: tuple[Any, ...] = () if scope is None else (scope,)
        sql = (
            "SELECT scope, status, count(*) AS n,"
            " extract(epoch FROM now() - min(updated_at)) AS oldest_s,"
            " count(*) FILTER (WHERE status = 'unknown' AND reconcile_after <= now()) AS due,"
            " count(*) FILTER (WHERE status = 'unknown' AND reconcile_after IS NULL) AS operator"
            f" FROM {self.table} {where} GROUP BY scope, status ORDER BY scope, status"
        )
        rows = await self._run(
            "stats",
            scope or "",
            None,
            lambda c: c.fetch(sql, *args, timeout=self.command_timeout),
        )
        scopes: dict[str, dict[str, int]] = {}
        oldest: dict[str, float] = {}
        backlog = operator = 0
        for r in rows:
            scopes.setdefault(r["scope"], {})[r["status"]] = r["n"]
            if r["status"] in ("in_progress", "unknown"):
                oldest[r["status"]] = max(oldest.get(r["status"], 0.0), float(r["oldest_s"]))
            backlog += r["due"]
            operator += r["operator"]
        return {
            "scopes": scopes,
            "oldest_in_progress_s": oldest.get("in_progress"),
            "oldest_unknown_s": oldest.get("unknown"),
            "reconcile_backlog": backlog,
            "with_operator": operator,
        }

    # --- operators -----------------------------------------------------------------------------

    async def get(self, scope: str, key: str) -> Record | None:
        async def call(c: Any) -> Any:
            return await c.fetchrow(
                f"SELECT * FROM {self.table} WHERE scope = $1 AND key = $2",
                scope,
                key,
                timeout=self.command_timeout,
            )

        row = await self._run("get", scope, None, call)
        return None if row is None else Record.from_row(row)

    async def evict(self, scope: str, key: str, *, token: uuid.UUID | None = None) -> bool:
        """Delete a record. With ``token``, only while that owner still holds it (an owner
        cleaning up after itself); without, unconditionally (an operator)."""
        args: tuple[Any, ...]
        # a kept original goes with its record: a later record of the same key must never
        # re-dispatch an older message
        outbox = f'"{self.schema}".redispatch_outbox'
        if token is None:
            sql = (
                f"WITH kept AS (DELETE FROM {outbox} WHERE scope = $1 AND key = $2)"
                f" DELETE FROM {self.table} WHERE scope = $1 AND key = $2"
            )
            args = (scope, key)
        else:
            sql = f"DELETE FROM {self.table} WHERE scope = $1 AND key = $2 AND owner_token = $3"
            args = (scope, key, token)

        async def call(c: Any) -> Any:
            return await c.execute(sql, *args, timeout=self.command_timeout)

        if self.cache is not None:
            await self.cache.delete([(scope, key)])
        status: str = await self._run("evict", scope, None, call)
        deleted = status.endswith(" 1")
        if self.cache is not None:  # again: a read racing the delete may have re-cached it
            await self.cache.delete([(scope, key)])
        if token is not None and not deleted:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"evict: ({scope!r}, {key!r}) is no longer held by this owner")
        return deleted

    async def sweep(self, *, batch_size: int = 500) -> int:
        """Park every in-progress record whose lease has expired as ``unknown`` (a zombie:
        its owner may have acted before it vanished). Returns how many were parked."""
        sql = (
            f"UPDATE {self.table} t SET status = 'unknown', owner_token = NULL,"
            " locked_until = NULL, last_error = 'lease_expired', reconcile_after = now(),"
            " reconcile_published_at = NULL, updated_at = now()"
            f" FROM (SELECT scope, key FROM {self.table} WHERE status = 'in_progress'"
            " AND locked_until < clock_timestamp() ORDER BY locked_until LIMIT $1"
            " FOR UPDATE SKIP LOCKED) due"
            " WHERE t.scope = due.scope AND t.key = due.key AND t.status = 'in_progress'"
            " RETURNING t.scope"
        )
        total = 0
        while True:
            rows = await self._run(
                "sweep",
                "",
                None,
                lambda c: c.fetch(sql, batch_size, timeout=self.command_timeout),
            )
            for scope, n in Counter(r["scope"] for r in rows).items():
                self.metrics.inc("zombie", scope, n)
                self.metrics.inc("unknown", scope, n)
            total += len(rows)
            if len(rows) < batch_size:
                return total

    async def prune(
        self,
        *,
        policy: PrunePolicy = PrunePolicy.DELETE,
        batch_size: int = 1000,
        max_batches: int | None = None,
        audit_retention: timedelta | float = timedelta(days=30),
    ) -> int:
        """Remove records past ``expires_at`` in small batches (short locks, SKIP LOCKED so several
        pruners can run at once). Never touches ``in_progress`` or ``unknown`` records: those
        still need an owner or an operator. With ``SOFT``, completed and failed records become
        ``expired`` (kept ``audit_retention`` longer, never replayed) and expired ones are deleted.
        Returns the number of rows deleted or soft-expired."""
        live = "('completed', 'failed_retryable', 'expired')"
        if policy is PrunePolicy.DELETE:
            sql = (
                f"DELETE FROM {self.table} t USING (SELECT scope, key FROM {self.table}"
                f" WHERE expires_at < now() AND status IN {live} LIMIT $1 FOR UPDATE SKIP LOCKED) d"
                " WHERE t.scope = d.scope AND t.key = d.key RETURNING t.scope, t.key"
            )
            args: tuple[Any, ...] = (batch_size,)
        else:
            sql = (
                f"WITH d AS (SELECT scope, key, status FROM {self.table}"
                f" WHERE expires_at < now() AND status IN {live} LIMIT $1 FOR UPDATE SKIP LOCKED),"
                f" gone AS (DELETE FROM {self.table} t USING d WHERE t.scope = d.scope"
                " AND t.key = d.key AND d.status = 'expired' RETURNING t.scope, t.key),"
                f" soft AS (UPDATE {self.table} t SET status = 'expired', updated_at = now(),"
                " expires_at = now() + $2::interval FROM d WHERE t.scope = d.scope"
                " AND t.key = d.key AND d.status <> 'expired' RETURNING t.scope, t.key)"
                " SELECT scope, key FROM gone UNION ALL SELECT scope, key FROM soft"
            )
            args = (batch_size, _seconds(audit_retention))
        report = PruneReport()
        while max_batches is None or report.batches < max_batches:
            started = time.perf_counter()
            rows = await self._run(
                "prune", "", None, lambda c: c.fetch(sql, *args, timeout=self.command_timeout)
            )
            report.longest_statement_s = max(
                report.longest_statement_s, time.perf_counter() - started
            )
            for scope, n in Counter(r["scope"] for r in rows).items():
                self.metrics.inc("pruned", scope, n)
            if self.cache is not None:  # expired records are never replayed: drop them
                await self.cache.delete((r["scope"], r["key"]) for r in rows)
            report.rows += len(rows)
            report.batches += 1
            if len(rows) < batch_size:
                break
        self.last_prune = report
        return report.rows

    # --- the re-dispatch outbox (reconciliation: "not executed") -------------------------------
    #
    # A row is either *unarmed* (due_at NULL): the original message of an ``unknown`` record,
    # kept because a delivery of it was acked (keep_original), held until the record is
    # resolved; or *armed*: the record was resolved "not executed" and the message must be sent
    # again (the sweeper sends every due armed row; a confirmed send deletes it).

    @property
    def _outbox(self) -> str:
        return f'"{self.schema}".redispatch_outbox'

    _OUTBOX_COLUMNS = (
        "scope, key, source, body, header_names, header_values, record_key, properties, due_at"
    )

    @staticmethod
    def _outbox_args(notice: Notice) -> tuple[Any, ...]:
        if not notice.original:
            raise ValueError("the outbox needs the notice's source and original body")
        names = list(notice.headers)
        return (
            notice.source,
            notice.body,
            names,
            [notice.headers[n] for n in names],
            notice.record_key,
            json.dumps(notice.properties),
        )

    @staticmethod
    def _pending(row: Any) -> PendingRedispatch:
        properties = row["properties"]
        if isinstance(properties, str):
            properties = json.loads(properties)
        return PendingRedispatch(
            id=row["id"],
            notice=Notice(
                scope=row["scope"],
                key=row["key"],
                source=row["source"],
                body=bytes(row["body"]),
                headers={
                    n: bytes(v)
                    for n, v in zip(row["header_names"], row["header_values"], strict=True)
                },
                record_key=None if row["record_key"] is None else bytes(row["record_key"]),
                properties=clean_properties(properties),
            ),
            attempts=row["attempts"],
            last_error=row["last_error"],
            armed=row["due_at"] is not None,
        )

    async def keep_original(self, scope: str, key: str, notice: Notice) -> Status | None:
        """Keep the original message of an ``unknown`` record before a delivery of it is acked:
        an unarmed outbox row, held until the record is resolved (then armed or deleted in the
        resolution's transaction). Returns the record's status: the original is kept only while
        it is ``unknown``. Anything else means it was resolved meanwhile (``completed``: acking
        is right; ``failed_retryable``, in progress or gone: do not ack, let the delivery run).

        The record row is locked (``FOR SHARE``) while the original is written, so a resolution
        either comes first (and this keeps nothing) or sees what was kept. An existing unarmed
        row stays as it is (the same message); an armed one, left from an earlier round whose
        re-dispatch has not been confirmed yet, is disarmed and renumbered (its pending send no
        longer deletes it)."""
        sql = (
            f"WITH r AS (SELECT status FROM {self.table} WHERE scope = $1 AND key = $2"
            " FOR SHARE),"
            f" kept AS (INSERT INTO {self._outbox} AS o ({self._OUTBOX_COLUMNS})"
            " SELECT $1::text, $2::text, $3::text, $4::bytea, $5::text[], $6::bytea[], $7::bytea,"
            " $8::jsonb, NULL::timestamptz FROM r WHERE r.status = 'unknown'"
            " ON CONFLICT (scope, key) DO UPDATE SET id = DEFAULT, source = EXCLUDED.source,"
            " body = EXCLUDED.body, header_names = EXCLUDED.header_names,"
            " header_values = EXCLUDED.header_values, record_key = EXCLUDED.record_key,"
            " properties = EXCLUDED.properties, attempts = 0, last_error = NULL, due_at = NULL,"
            " created_at = now() WHERE o.due_at IS NOT NULL RETURNING 1)"
            " SELECT status FROM r"
        )
        args = self._outbox_args(notice)
        status = await self._run(
            "keep_original",
            scope,
            None,
            lambda c: c.fetchval(sql, scope, key, *args, timeout=self.command_timeout),
        )
        return None if status is None else Status(status)

    async def kept_original(self, scope: str, key: str) -> PendingRedispatch | None:
        """The outbox row of a key, armed or not (``PendingRedispatch.armed``), or None."""
        sql = f"SELECT * FROM {self._outbox} WHERE scope = $1 AND key = $2"
        row = await self._run(
            "kept_original",
            scope,
            None,
            lambda c: c.fetchrow(sql, scope, key, timeout=self.command_timeout),
        )
        return None if row is None else self._pending(row)

    async def redispatch_count(self, scope: str, key: str) -> int:
        """How many times reconciliation re-dispatched this key's original message."""
        sql = f"SELECT redispatches FROM {self.table} WHERE scope = $1 AND key = $2"
        count = await self._run(
            "redispatch_count",
            scope,
            None,
            lambda c: c.fetchval(sql, scope, key, timeout=self.command_timeout),
        )
        return int(count or 0)

    async def _settle_original(
        self,
        c: Any,
        scope: str,
        key: str,
        resolution: Resolution,
        notice: Notice | None,
        due_in: timedelta | float,
    ) -> PendingRedispatch | None:
        """Inside a resolution's transaction: delete the kept original (executed), or arm it,
        or the one ``notice`` carries when none was kept (not executed), counting the
        re-dispatch on the record."""
        if isinstance(resolution, Executed):
            await c.execute(
                f"DELETE FROM {self._outbox} WHERE scope = $1 AND key = $2",
                scope,
                key,
                timeout=self.command_timeout,
            )
            return None
        arm = "id = DEFAULT, attempts = 0, last_error = NULL, due_at = now() + $3::interval"
        if notice is not None and notice.original:
            # the kept original wins over the notice's copy (the same message; it was kept
            # with everything the transport knew)
            row = await c.fetchrow(
                f"INSERT INTO {self._outbox} AS o ({self._OUTBOX_COLUMNS})"
                " VALUES ($1, $2, $4, $5, $6, $7, $8, $9::jsonb, now() + $3::interval)"
                f" ON CONFLICT (scope, key) DO UPDATE SET {arm} RETURNING *",
                scope,
                key,
                _seconds(due_in),
                *self._outbox_args(notice),
                timeout=self.command_timeout,
            )
        else:
            row = await c.fetchrow(
                f"UPDATE {self._outbox} SET {arm} WHERE scope = $1 AND key = $2 RETURNING *",
                scope,
                key,
                _seconds(due_in),
                timeout=self.command_timeout,
            )
        if row is None:
            return None
        await c.execute(
            f"UPDATE {self.table} SET redispatches = redispatches + 1"
            " WHERE scope = $1 AND key = $2",
            scope,
            key,
            timeout=self.command_timeout,
        )
        return self._pending(row)

    async def resolve_not_executed(
        self,
        scope: str,
        key: str,
        resolution: NotExecuted,
        notice: Notice | None = None,
        *,
        due_in: timedelta | float = timedelta(seconds=60),
    ) -> PendingRedispatch | None:
        """Resolve an ``unknown`` record as not executed and, in the same transaction, arm its
        original message for a re-dispatch (due after ``due_in``): the one kept by
        :meth:`keep_original`, else the one ``notice`` carries. Returns the armed outbox row
        (send it, then :meth:`redispatch_done`), or None when no original exists anywhere (no
        delivery of it was acked: the broker delivers it again). A crash after this commit
        cannot lose the work: the sweeper sends every due armed row. Raises
        :class:`NotUnknown` if the record is not ``unknown``."""
        _, entry = await self._resolve(scope, key, resolution, notice=notice, due_in=due_in)
        return entry

    async def resolve_with_redispatch(
        self,
        scope: str,
        key: str,
        resolution: NotExecuted,
        notice: Notice,
        *,
        due_in: timedelta | float = timedelta(seconds=60),
    ) -> int:
        """:meth:`resolve_not_executed` for a notice that carries the original; returns the
        armed outbox row's id."""
        if not notice.original:
            raise ValueError("a re-dispatch needs the notice's source and original body")
        entry = await self.resolve_not_executed(scope, key, resolution, notice, due_in=due_in)
        assert entry is not None
        return entry.id

    async def pending_redispatches(
        self, limit: int = 100, scopes: Sequence[str] | None = None, *, due_only: bool = True
    ) -> list[PendingRedispatch]:
        """Armed outbox rows whose re-dispatch is due (all armed ones with ``due_only=False``).
        Unarmed rows (originals kept for unresolved records) are never pending."""
        sql = (
            f"SELECT * FROM {self._outbox} WHERE due_at IS NOT NULL"
            " AND (NOT $3 OR due_at <= now())"
            " AND ($2::text[] IS NULL OR scope = ANY($2::text[])) ORDER BY due_at LIMIT $1"
        )
        wanted = None if scopes is None else list(scopes)
        rows = await self._run(
            "pending_redispatches",
            "",
            None,
            lambda c: c.fetch(sql, limit, wanted, due_only, timeout=self.command_timeout),
        )
        return [self._pending(r) for r in rows]

    async def redispatch_done(self, outbox_id: int) -> None:
        """The broker confirmed the re-dispatch: drop its outbox row (only that one: a row kept
        again meanwhile has a new id)."""
        sql = f"DELETE FROM {self._outbox} WHERE id = $1 AND due_at IS NOT NULL"
        await self._run(
            "redispatch_done",
            "",
            None,
            lambda c: c.execute(sql, outbox_id, timeout=self.command_timeout),
        )

    async def redispatch_failed(
        self, outbox_id: int, error: str, retry_in: timedelta | float
    ) -> None:
        """A re-dispatch attempt failed: count it, keep the error, try again after ``retry_in``."""
        sql = (
            f"UPDATE {self._outbox} SET attempts = attempts + 1, last_error = $2,"
            " due_at = now() + $3::interval WHERE id = $1 AND due_at IS NOT NULL"
        )
        await self._run(
            "redispatch_failed",
            "",
            None,
            lambda c: c.execute(
                sql, outbox_id, error[:500], _seconds(retry_in), timeout=self.command_timeout
            ),
        )
