"""The transactional fast path: claim, work and complete in the caller's one transaction.

A first delivery costs two round trips: ``BEGIN`` + the claim in one simple query, the result +
``COMMIT`` in another. The claim row is written ``completed`` at once: nobody sees it before the
commit, and a rollback takes it away. On a connection that runs units back to back, the next
unit's BEGIN + claim rides after this one's COMMIT (`Ahead`): one round trip a unit. Batch
mode claims and completes many keys per statement.
"""

from __future__ import annotations

import json
import logging
import secrets
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg

from consumer_idem.commit import (
    MARK_SETTING,
    check_sql,
    commit,
    execute_and_commit,
    prepare_check_sql,
    rollback,
    run_check_sql,
)
from consumer_idem.errors import KeyInFlight
from consumer_idem.stores.postgres.ahead import DONE_SETTING as DONE_SETTING
from consumer_idem.stores.postgres.ahead import Ahead as Ahead
from consumer_idem.stores.postgres.ahead import AheadRun, committed_before, running_on
from consumer_idem.stores.postgres.migrate import per_schema_name
from consumer_idem.stores.results import encode_result
from consumer_idem.types import Record, ResultKind, Status, StoredResponse

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

#: after a plain batch claim met an existing key: how many of the scope's next batches claim
#: with ON CONFLICT at once (see :meth:`FastPath.claim_many`)
PLAIN_CLAIM_PAUSE = 16


def dollar_quote(text: str) -> str:
    """A SQL literal for ``text`` with a dollar-quote tag that does not occur in it.

    Only for the fast path, which sends BEGIN+claim and result+COMMIT as one simple-protocol
    query each (simple queries carry no parameters). Dollar quoting has no escapes; excluding
    ``$tag`` from the text means no closing tag can form inside or across it. Keys and scopes
    never hold NUL (key hygiene rejects control characters) and JSON escapes it.
    """
    tag = "ci"
    while "$" + tag in text:  # rare: only then pay for a random tag
        tag = "ci" + secrets.token_hex(4)
    return f"${tag}${text}${tag}$"


log = logging.getLogger("consumer_idem.stores.postgres.fast_path")


def completed_record(
    store: PostgresStore,
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
        expires_at=now + store.retention_for(scope, retention),
    )


class FastPath:
    """The store's transactional fast path (``store.fast_path``), used by the claim engine and
    batch mode. Methods run on the caller's connection, inside the caller's transaction."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self._claim_stmt = per_schema_name("consumer_idem_claim", store.schema)
        self._result_stmt = per_schema_name("consumer_idem_result", store.schema)
        self._check_stmt = per_schema_name("consumer_idem_check", store.schema)
        #: the check that also notes the mark in DONE_SETTING (before a COMMIT with a claim after)
        self._check_done_stmt = per_schema_name("consumer_idem_checkdone", store.schema)
        #: per scope: batches left that claim with ON CONFLICT straight away (after a conflict)
        self._plain_claims_skipped: dict[str, int] = {}

    @property
    def prepared(self) -> bool:
        """Whether the fast path keeps its statements prepared on each connection: not behind
        a transaction pooler, where the next transaction may run on another server connection
        (the statements are then sent as text, in the transaction that runs them)."""
        return self.store.pooler != "transaction"

    def _claim_sql(self, scope: str, key: str, fingerprint: str, secs: str, mark: str) -> str:
        # the transaction's mark (see consumer_idem.commit) is set by the claim itself rather
        # than by a SET LOCAL of its own: one statement fewer for Postgres to parse and run in
        # every unit. The subquery yields its one row whatever the claim finds.
        return (
            f"INSERT INTO {self.store.table} (scope, key, fingerprint, status, result_kind,"
            f" completed_at, expires_at) SELECT {scope}, {key}, {fingerprint}, 'completed',"
            f" 'success', now(), now() + make_interval(secs => {secs}) FROM (SELECT CASE WHEN"
            f" {mark} IS NOT NULL THEN set_config('{MARK_SETTING}', {mark}, true) END) AS marked"
            " ON CONFLICT (scope, key) DO NOTHING"
        )

    def _result_sql(self, scope: str, key: str, result: str) -> str:
        return (
            f"UPDATE {self.store.table} SET result = {result}::json"
            f" WHERE scope = {scope} AND key = {key}"
        )

    def _fast_path_statements(self) -> dict[str, str]:
        # Server-side prepared statements: the fast path sends simple-protocol queries (to batch
        # BEGIN/COMMIT with a statement), and those would otherwise be planned on every call.
        return {
            self._claim_stmt: (
                f"PREPARE {self._claim_stmt}(text, text, text, float8, text) AS"
                f" {self._claim_sql('$1', '$2', '$3', '$4', '$5')}"
            ),
            self._result_stmt: (
                f"PREPARE {self._result_stmt}(text, text, text) AS"
                f" {self._result_sql('$1', '$2', '$3')}"
            ),
            self._check_stmt: prepare_check_sql(self._check_stmt),
            self._check_done_stmt: prepare_check_sql(
                self._check_done_stmt, f"set_config('{DONE_SETTING}', $1, false)"
            ),
        }

    def check(self, mark: str) -> str:
        """The transaction check (`check_sql`) for a connection
        that claimed with `begin_and_claim`, which prepared it there."""
        if not self.prepared:
            return check_sql(mark)
        return run_check_sql(self._check_stmt, mark)

    async def _prepare_fast_path(self, conn: asyncpg.Connection) -> None:
        """Prepare those of the fast path's statements ``conn`` lacks, in one query (outside a
        transaction). A connection can lack some only: the check when a handler deallocated
        it, which `heal` repairs. Never behind a transaction pooler."""
        if not self.prepared:
            return
        statements = self._fast_path_statements()
        existing = {
            r["name"]
            for r in await conn.fetch(
                "SELECT name FROM pg_prepared_statements WHERE name = ANY($1::text[])",
                list(statements),
            )
        }
        missing = [sql for name, sql in statements.items() if name not in existing]
        if missing:
            await conn.execute("; ".join(missing))

    async def heal(self, conn: asyncpg.Connection) -> None:
        """After a completion that met a missing prepared statement (rolled back by now): put
        the statements back, or the connection would fail every later unit (the claim only
        prepares them when the claim statement itself is missing). A failure here is left to
        the next unit on the connection, which then fails the same way, and is only logged."""
        try:
            if not conn.is_closed() and not conn.is_in_transaction():
                await self._prepare_fast_path(conn)
        except Exception:
            log.warning("preparing the fast path's statements again failed", exc_info=True)

    def _begin_and_claim_sql(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        retention: timedelta | float | None,
        lock_timeout_ms: int | None,
        mark: str | None,
    ) -> str:
        retention_s = self.store.retention_for(scope, retention).total_seconds()
        timeout = (
            "" if lock_timeout_ms is None else f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}; "
        )
        if not self.prepared:
            return (
                f"BEGIN; {timeout}{self._literal_claim(scope, key, fingerprint, retention_s, mark)}"
            )
        marked = "NULL" if mark is None else f"'{mark}'"
        args = (dollar_quote(scope), dollar_quote(key), dollar_quote(fingerprint))
        values = ", ".join((*args, repr(retention_s), marked))
        return f"BEGIN; {timeout}EXECUTE {self._claim_stmt}({values})"

    def _literal_claim(
        self, scope: str, key: str, fingerprint: str, retention_s: float, mark: str | None
    ) -> str:
        """The claim statement with its values as literals (no prepared statement to name)."""
        marked = "NULL" if mark is None else f"'{mark}'"
        return self._claim_sql(
            dollar_quote(scope),
            dollar_quote(key),
            dollar_quote(fingerprint),
            f"{retention_s!r}::float8",
            f"{marked}::text",
        )

    # --- the next unit's claim, in the round trip of this unit's COMMIT ---------------------

    def run_on(self, conn: Any) -> AheadRun:
        """``async with store.fast_path.run_on(conn) as run``: units run back to back on
        ``conn``, each asking for the next one's claim (`AheadRun.ask`) to ride after
        its COMMIT. Not behind a transaction pooler: whether the COMMIT before it happened is
        read from a session setting there (`committed_before`)."""
        return AheadRun(conn, self.store, enabled=self.prepared)

    def take_ahead(
        self,
        conn: Any,
        scope: str,
        key: str,
        fingerprint: str,
        retention: timedelta | float | None,
    ) -> Ahead | None:
        """The transaction begun ahead on ``conn`` for this unit, its claim made: ``None``
        when there is none (see `AheadRun.take`)."""
        run = running_on(conn)
        return None if run is None else run.take(scope, key, fingerprint, retention)

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
        ``mark``: a `new_mark` the transaction carries, so its
        COMMIT can check it is still the same transaction.

        The claim row is written as ``completed`` straight away: nobody can see it before this
        transaction commits (a duplicate blocks on the unique index until then), and if the
        transaction rolls back it never existed. Returns False when a row already exists; the
        transaction stays open and the caller falls back to `reserve` on ``conn``.

        With ``lock_timeout_ms``, a duplicate does not wait longer than that for the first
        claim's transaction: it raises [`KeyInFlight`][consumer_idem.KeyInFlight] (the transaction
        is then aborted;
        roll it back). HTTP uses this to answer 409 instead of holding a connection.
        """
        sql = self._begin_and_claim_sql(scope, key, fingerprint, retention, lock_timeout_ms, mark)
        # a transaction begun ahead for a unit that took no claim: it goes, in this round trip
        run = running_on(conn)
        stale = "ROLLBACK; " if run is not None and run.drop_begun() else ""

        async def claim(c: Any) -> str:
            try:
                status: str = await c.execute(stale + sql)
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

        status = await self.store.run("claim", scope, conn, call)
        claimed = status == "INSERT 0 1"
        if claimed:
            self.store.metrics.inc("created", scope)
        return claimed

    async def probe_claim(self, scope: str, key: str, wait_ms: int = 200) -> str:
        """Who has (``scope``, ``key``), where a read found no record? A transaction still open
        elsewhere has its claim's row invisible until it commits, so this claims the key in a
        transaction of its own, rolled back at once: ``"open"`` when the claim waited longer
        than ``wait_ms`` on the unique index (for that open transaction), ``"row"`` when a row
        is there now (committed since the read), ``"none"`` when nobody has it. Raises the
        store's error when the store does not answer."""
        retention = self.store.retention_for(scope, None).total_seconds()
        claim = self._literal_claim(scope, key, "probe", retention, None)
        sql = f"BEGIN; SET LOCAL lock_timeout = {int(wait_ms)}; {claim}"

        async def probe(c: Any) -> str:
            try:
                status = await c.execute(sql)
            except asyncpg.LockNotAvailableError:
                return "open"
            finally:
                await rollback(c)
            return "none" if status == "INSERT 0 1" else "row"

        return await self.store.run("probe_claim", scope, None, probe)

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
        `begin_and_claim`, run ``then`` (a statement of the library's own, e.g. a NOTIFY)
        and COMMIT, in one round trip, checking the commit's tag: raises
        [`CommitRolledBack`][consumer_idem.errors.CommitRolledBack] when the transaction had been
        aborted.
        Other errors propagate as raised (the caller classifies them).

        With a ``mark`` (the check runs first), the next unit's claim asked for on ``conn``
        (`AheadRun.ask`) rides after the COMMIT. The check makes the
        COMMIT's own tag redundant: a transaction that passed it is not aborted, so its COMMIT
        either commits or raises."""
        run = running_on(conn)
        ahead = None if run is None else run.pop_asked()
        if mark is None:  # (no mark, no check: the COMMIT's tag is read)
            statements = []
        elif ahead is None:
            statements = [self.check(mark)]
        else:  # the check notes the mark too, which lasts only if the COMMIT commits
            statements = [run_check_sql(self._check_done_stmt, mark)]
        where = f" WHERE scope = {dollar_quote(scope)} AND key = {dollar_quote(key)}"
        if response is not None:
            # literals, not parameters: a simple query can carry the COMMIT in the same round
            # trip (the body as hex, so no byte needs escaping)
            result = "" if encoded is None else f"result = {dollar_quote(encoded)}::json, "
            statements.append(
                f"UPDATE {self.store.table} SET {result}http_status = {int(response.status)},"
                f" http_headers = {dollar_quote(json.dumps(dict(response.headers)))}::jsonb,"
                f" http_body = decode('{response.body.hex()}', 'hex'){where}"
            )
        elif encoded is not None and not self.prepared:
            statements.append(
                self._result_sql(dollar_quote(scope), dollar_quote(key), dollar_quote(encoded))
            )
        elif encoded is not None:
            statements.append(
                f"EXECUTE {self._result_stmt}({dollar_quote(scope)}, {dollar_quote(key)},"
                f" {dollar_quote(encoded)})"
            )
        if then:
            statements.append(then)
        if ahead is None or mark is None:
            if statements:
                await execute_and_commit(conn, "; ".join(statements))
            else:
                await commit(conn)
            return
        begin = self._begin_and_claim_sql(
            ahead.scope, ahead.key, ahead.fingerprint, ahead.retention, None, ahead.mark
        )
        try:
            status = await conn.execute(f"{'; '.join(statements)}; COMMIT; {begin}")
        except Exception as exc:  # not a cancellation: that is the caller's to handle
            if await committed_before(conn, exc, mark, self._check_done_stmt, self.store):
                return  # the next unit begins on its own (and prepares a claim gone missing)
            raise
        ahead.claimed = status == "INSERT 0 1"
        assert run is not None
        run.begun = ahead

    async def claim_many(
        self,
        conn: asyncpg.Connection,
        scope: str,
        keys: list[str],
        fingerprints: list[str],
        retention: timedelta | float | None = None,
        *,
        restart: str | None = None,
    ) -> set[str]:
        """Batch mode: claim many new keys with one statement, inside the caller's transaction.
        Rows are written as ``completed`` (invisible until COMMIT, gone on rollback). Returns the
        keys claimed; the others already have a row and go through `reserve`.

        With ``restart`` (the SQL that opens the caller's transaction again: its BEGIN and
        mark; nothing may have run in it yet) a plain INSERT is tried first. When no key has a
        row yet, the usual batch, Postgres does about a third less work than for ON CONFLICT's
        speculative insertion (measured on 500 keys: 5-7 ms against 8-12 ms). A key that has
        a row makes it fail: the transaction is rolled back, opened again with ``restart`` and
        claimed with ON CONFLICT, and the scope's next `PLAIN_CLAIM_PAUSE` batches skip
        the plain attempt (a stream with duplicates would otherwise pay twice each time)."""
        retention_td = self.store.retention_for(scope, retention)
        columns = (
            f"INSERT INTO {self.store.table} (scope, key, fingerprint, status, result_kind,"
            " completed_at, expires_at)"
            " SELECT $1, u.k, u.f, 'completed', 'success', now(), now() + $4::interval"
            " FROM unnest($2::text[], $3::text[]) AS u(k, f)"
        )
        sql = columns + " ON CONFLICT (scope, key) DO NOTHING RETURNING key"
        timeout = self.store.command_timeout
        skip = self._plain_claims_skipped.get(scope, 0)
        if restart is not None and skip:
            self._plain_claims_skipped[scope] = skip - 1
        plain = restart is not None and not skip

        async def claim(c: Any) -> set[str]:
            if plain:
                try:
                    await c.execute(
                        columns, scope, keys, fingerprints, retention_td, timeout=timeout
                    )
                    return set(keys)
                except asyncpg.UniqueViolationError:
                    self._plain_claims_skipped[scope] = PLAIN_CLAIM_PAUSE
                    await c.execute(f"ROLLBACK; {restart}")
            rows = await c.fetch(sql, scope, keys, fingerprints, retention_td, timeout=timeout)
            return {r["key"] for r in rows}

        claimed = await self.store.run("claim_many", scope, conn, claim)
        self.store.metrics.inc("created", scope, len(claimed))
        return claimed

    async def store_results(
        self, conn: asyncpg.Connection, scope: str, keys: list[str], encoded: list[str]
    ) -> None:
        """Batch mode: set the JSON results of rows claimed by `claim_many`."""
        if not keys:
            return
        sql = (
            f"UPDATE {self.store.table} t SET result = u.r::json"
            " FROM unnest($2::text[], $3::text[]) AS u(k, r)"
            " WHERE t.scope = $1 AND t.key = u.k"
        )
        await self.store.run(
            "store_results",
            scope,
            conn,
            lambda c: c.execute(sql, scope, keys, encoded, timeout=self.store.command_timeout),
        )

    async def attach_response(
        self, conn: asyncpg.Connection, scope: str, key: str, response: StoredResponse
    ) -> None:
        """HTTP, transactional fast path: store the response on the row this transaction
        claimed with `begin_and_claim` (it commits with the endpoint's writes)."""
        sql = (
            f"UPDATE {self.store.table} SET http_status = $3, http_headers = $4::jsonb,"
            " http_body = $5"
            " WHERE scope = $1 AND key = $2"
        )
        await self.store.run(
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
                timeout=self.store.command_timeout,
            ),
        )

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
        retention_td = self.store.retention_for(scope, retention)
        sql = (
            f"INSERT INTO {self.store.table} AS t (scope, key, fingerprint, status, last_error,"
            " reconcile_after, expires_at)"
            " VALUES ($1, $2, $3, $4::text, $5, CASE WHEN $4::text = 'unknown' THEN now() END,"
            " now() + $6::interval)"
            " ON CONFLICT (scope, key) DO UPDATE SET status = EXCLUDED.status,"
            " attempts = t.attempts + 1, last_error = EXCLUDED.last_error,"
            " reconcile_after = EXCLUDED.reconcile_after, reconcile_published_at = NULL,"
            " updated_at = now(), expires_at = greatest(t.expires_at, EXCLUDED.expires_at)"
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
                timeout=self.store.command_timeout,
            )

        row = await self.store.run("record_failure", scope, conn, call)
        if row is None:
            return None
        self.store.metrics.inc("unknown" if status == "unknown" else "failed_retry", scope)
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
        retention_td = self.store.retention_for(scope, retention)
        sql = (
            f"INSERT INTO {self.store.table} AS t (scope, key, fingerprint, status, result,"
            " result_kind, completed_at, expires_at)"
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
                timeout=self.store.command_timeout,
            )

        row = await self.store.run("complete_new", scope, conn, call)
        return None if row is None else Record.from_row(row)
