"""The two execution modes: how a unit of work runs around a reservation.

* :func:`run_transactional` — the effect lives in the same Postgres: claim, handler, completion
  and COMMIT are one transaction. A crash anywhere before COMMIT leaves neither row nor effect.
* :func:`run_two_phase` — the effect is external I/O: the claim commits with a lease, the I/O
  runs outside any transaction, and the completion commits in a second transaction. Failures are
  classified (:class:`Retryable`, :class:`Ambiguous`, :class:`DomainError`); anything else is
  ambiguous, because the I/O may already have started.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol
from uuid import UUID

import asyncpg

from consumer_idem.errors import Ambiguous, DomainError, LeaseLost, Retryable, StoreUnavailable
from consumer_idem.store import PostgresStore, encode_result
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Outcome,
    OutcomeKind,
    Record,
    ResultKind,
)

log = logging.getLogger("consumer_idem.execution")

TransactionalHandler = Callable[[asyncpg.Connection], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Attempt:
    """What a two-phase action knows about its own attempt."""

    scope: str
    key: str
    token: UUID
    number: int  #: 1 for the first attempt, 2 after one failed_retryable, ...

    @property
    def downstream_key(self) -> str:
        """A stable key to pass to the external system (e.g. the gateway's own Idempotency-Key),
        the same on every attempt of this (scope, key), so the far side can dedupe as well."""
        digest = hashlib.sha256(f"{self.scope}\x00{self.key}".encode()).hexdigest()
        return f"ci-{digest[:40]}"


TwoPhaseAction = Callable[[Attempt], Awaitable[Any]]


class TwoPhaseStore(Protocol):
    """What two-phase execution needs: PostgresStore or RedisStore."""

    def check(self, scope: str, key: str | bytes) -> tuple[str, str]: ...

    async def reserve(
        self,
        scope: str,
        key: str | bytes,
        fingerprint: str,
        *,
        lease: timedelta | float | None = None,
        retention: timedelta | float | None = None,
    ) -> Decision: ...

    async def complete(
        self,
        scope: str,
        key: str,
        token: UUID,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        retention: timedelta | float | None = None,
    ) -> Record: ...

    async def fail_retryable(
        self, scope: str, key: str, token: UUID, error: str = ...
    ) -> Record: ...

    async def mark_unknown(self, scope: str, key: str, token: UUID, error: str = ...) -> Record: ...

    async def get(self, scope: str, key: str) -> Record | None: ...


LocalWrites = Callable[[asyncpg.Connection, Any], Awaitable[None]]


def outcome_of(decision: Decision) -> Outcome:
    """The outcome of a reservation that did not grant execution."""
    record = decision.record
    kind = {
        DecisionKind.REPLAY: OutcomeKind.REPLAYED,
        DecisionKind.IN_PROGRESS: OutcomeKind.IN_PROGRESS,
        DecisionKind.MISUSE: OutcomeKind.MISUSE,
        DecisionKind.UNKNOWN: OutcomeKind.UNKNOWN,
    }[decision.kind]
    return Outcome(
        kind=kind,
        scope=record.scope,
        key=record.key,
        result=record.result if kind is OutcomeKind.REPLAYED else None,
        result_kind=record.result_kind,
        record=record,
        attempts=record.attempts,
        retry_after=decision.retry_after,
        parked_now=decision.zombie,
    )


def _failed(
    record: Record | None,
    scope: str,
    key: str,
    exc: BaseException,
    kind: OutcomeKind,
    parked_now: bool = False,
) -> Outcome:
    return Outcome(
        kind=kind,
        scope=scope,
        key=key,
        record=record,
        error=exc,
        attempts=record.attempts if record else 0,
        parked_now=parked_now,
    )


def _error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{code or type(exc).__name__}: {exc}"[:500]


async def run_transactional(
    store: PostgresStore,
    scope: str,
    key: str | bytes,
    fingerprint: str,
    handler: TransactionalHandler,
    *,
    retention: timedelta | float | None = None,
    conn: asyncpg.Connection | None = None,
) -> Outcome:
    """Claim, run ``handler(conn)`` and complete in one transaction, then commit.

    The handler gets the open connection and must do its database writes on it. Its return
    value (JSON-serialisable) is stored as the result. A concurrent duplicate blocks on the
    unique index until this commits, then replays. If the handler raises, everything rolls back:
    :class:`DomainError` is stored as a completed domain-error result, :class:`Ambiguous` parks
    the key as ``unknown``, anything else is ``failed_retryable`` (nothing was committed).

    A new key costs three round trips, like the handler's write alone (BEGIN+claim, the
    handler's statements, result+COMMIT); a key that already has a row goes through
    :meth:`PostgresStore.reserve` inside the same transaction. Pass ``conn`` (not in a
    transaction) to run on a connection you hold, e.g. one per consumer worker, instead of a
    pooled one.
    """
    scope, key = store.check(scope, key)
    cached = await store.cached_decision(scope, key, fingerprint)
    if cached is not None:  # a duplicate of completed work: no Postgres round trip at all
        return outcome_of(cached)
    async with store.connection(conn) as conn:
        try:
            token: UUID | None = None
            record: Record | None = None
            attempts = 1
            if not await store.begin_and_claim(conn, scope, key, fingerprint, retention):
                decision = await store.reserve(
                    scope, key, fingerprint, retention=retention, conn=conn
                )
                if decision.kind is not DecisionKind.EXECUTE:
                    await _commit(store, conn, scope, conn.execute("COMMIT"))
                    return outcome_of(decision)
                token, attempts = decision.token, decision.record.attempts
            try:
                result = await handler(conn)
                encoded = encode_result(result)  # an unstorable result is a handler failure
            except (Exception, asyncio.CancelledError) as exc:
                await _rollback(conn)
                return await _after_rollback(store, conn, scope, key, fingerprint, exc, retention)
            try:
                if token is None:
                    await _commit(
                        store, conn, scope, store.commit_claimed(conn, scope, key, encoded)
                    )
                else:
                    record = await store.complete(
                        scope, key, token, result, retention=retention, conn=conn
                    )
                    await _commit(store, conn, scope, conn.execute("COMMIT"))
            except _Refused as refused:
                # the server refused the commit (a deferred constraint of the handler's, a
                # serialization failure): it rolled back, so this is a retryable handler failure
                await _rollback(conn)
                cause = refused.__cause__ or refused
                return await _after_rollback(store, conn, scope, key, fingerprint, cause, retention)
        except BaseException:
            await _rollback(conn)
            raise
    if store.cache is not None:
        await store.remember(
            record or store.completed_record(scope, key, fingerprint, encoded, retention)
        )
    return Outcome(
        kind=OutcomeKind.EXECUTED,
        scope=scope,
        key=key,
        result=result,
        result_kind=ResultKind.SUCCESS,
        record=record,
        attempts=attempts,
    )


class _Refused(Exception):
    """The server answered a COMMIT with an error: the transaction was rolled back."""


async def _commit(store: PostgresStore, conn: Any, scope: str, commit: Awaitable[Any]) -> None:
    try:
        await commit
    except asyncpg.PostgresError as exc:
        if isinstance(exc, asyncpg.PostgresConnectionError) or conn.is_closed():
            raise store._unavailable("commit", exc, scope) from exc
        raise _Refused(str(exc)) from exc
    except Exception as exc:
        # The commit may or may not have reached the server; both outcomes are atomic
        # (row and effect together), so the redelivery settles it: replay or execute.
        raise store._unavailable("commit", exc, scope) from exc


async def _rollback(conn: Any) -> None:
    try:
        if not conn.is_closed() and conn.is_in_transaction():
            await conn.execute("ROLLBACK")
    except Exception:  # the connection is gone: nothing was committed
        log.debug("rollback failed", exc_info=True)


async def _after_rollback(
    store: PostgresStore,
    conn: Any,
    scope: str,
    key: str,
    fingerprint: str,
    exc: BaseException,
    retention: timedelta | float | None,
) -> Outcome:
    """The transactional attempt was rolled back: nothing of it is in the database."""
    if isinstance(exc, asyncio.CancelledError):
        raise exc  # shutting down: the redelivery will run it; nothing to record
    if isinstance(exc, DomainError):
        record = await store.complete_new(
            scope,
            key,
            fingerprint,
            exc.result,
            ResultKind.DOMAIN_ERROR,
            retention=retention,
            conn=conn,
        )
        if record is None:  # someone else holds the key now: report what they have
            decision = await store.reserve(scope, key, fingerprint, retention=retention, conn=conn)
            return outcome_of(decision)
        return Outcome(
            kind=OutcomeKind.EXECUTED,
            scope=scope,
            key=key,
            result=exc.result,
            result_kind=ResultKind.DOMAIN_ERROR,
            record=record,
            attempts=record.attempts,
        )
    status = "unknown" if isinstance(exc, Ambiguous) else "failed_retryable"
    log.warning(
        "transactional handler failed (%s): %r", status, exc, extra={"scope": scope, "key": key}
    )
    failed = await store.record_failure(
        scope, key, fingerprint, status, _error_code(exc), retention=retention, conn=conn
    )
    kind = OutcomeKind.UNKNOWN if status == "unknown" else OutcomeKind.FAILED_RETRYABLE
    return _failed(failed, scope, key, exc, kind, parked_now=kind is OutcomeKind.UNKNOWN)


async def run_two_phase(
    store: TwoPhaseStore,
    scope: str,
    key: str | bytes,
    fingerprint: str,
    action: TwoPhaseAction,
    *,
    local_writes: LocalWrites | None = None,
    lease: timedelta | float | None = None,
    retention: timedelta | float | None = None,
) -> Outcome:
    """Claim with a lease, run ``action(attempt)`` outside any transaction, then complete.

    ``local_writes(conn, result)``, if given, runs in the completion's transaction, so local rows
    commit with the completion. Outcomes by exception: :class:`Retryable` -> ``failed_retryable``;
    :class:`DomainError` -> ``completed`` with the error result; :class:`Ambiguous` or any other
    exception (the I/O may have started) -> ``unknown``. Cancellation also parks as ``unknown``.
    """
    scope, key = store.check(scope, key)
    decision = await store.reserve(scope, key, fingerprint, lease=lease, retention=retention)
    if decision.kind is not DecisionKind.EXECUTE:
        return outcome_of(decision)
    token = decision.token
    attempt = Attempt(scope, key, token, decision.record.attempts)
    try:
        result = await action(attempt)
    except Retryable as exc:
        record = await store.fail_retryable(scope, key, token, _error_code(exc))
        return _failed(record, scope, key, exc, OutcomeKind.FAILED_RETRYABLE)
    except DomainError as exc:
        try:
            record = await store.complete(
                scope,
                key,
                token,
                exc.result,
                result_kind=ResultKind.DOMAIN_ERROR,
                retention=retention,
            )
        except LeaseLost as lost:
            return _failed(await store.get(scope, key), scope, key, lost, OutcomeKind.UNKNOWN)
        return Outcome(
            kind=OutcomeKind.EXECUTED,
            scope=scope,
            key=key,
            result=exc.result,
            result_kind=ResultKind.DOMAIN_ERROR,
            record=record,
            attempts=record.attempts,
        )
    except (Exception, asyncio.CancelledError) as exc:
        # Ambiguous, or unclassified: the external call may have happened. Park, never re-run.
        try:
            record = await asyncio.shield(store.mark_unknown(scope, key, token, _error_code(exc)))
        except LeaseLost as lost:
            # the lease already expired and the sweeper parked it: still unknown, not by us
            return _failed(await store.get(scope, key), scope, key, lost, OutcomeKind.UNKNOWN)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return _failed(record, scope, key, exc, OutcomeKind.UNKNOWN, parked_now=True)

    try:
        record = await _complete_with_local_writes(
            store, scope, key, token, result, local_writes, retention
        )
    except LeaseLost as lost:
        # Fenced: our lease expired before we could complete and the record was parked as
        # unknown. We must not overwrite that; reconciliation settles it.
        return _failed(await store.get(scope, key), scope, key, lost, OutcomeKind.UNKNOWN)
    return Outcome(
        kind=OutcomeKind.EXECUTED,
        scope=scope,
        key=key,
        result=result,
        result_kind=ResultKind.SUCCESS,
        record=record,
        attempts=record.attempts,
    )


async def _complete_with_local_writes(
    store: TwoPhaseStore,
    scope: str,
    key: str,
    token: UUID,
    result: Any,
    local_writes: LocalWrites | None,
    retention: timedelta | float | None,
) -> Record:
    if local_writes is None:
        return await store.complete(scope, key, token, result, retention=retention)
    if not isinstance(store, PostgresStore):
        raise TypeError("local_writes need the Postgres store (a transaction with your rows)")
    async with store.connection() as conn:
        try:
            async with conn.transaction():
                await local_writes(conn, result)
                record = await store.complete(
                    scope, key, token, result, retention=retention, conn=conn
                )
            await store.remember(record)  # committed now
            return record
        except (LeaseLost, StoreUnavailable):
            raise
        except Exception as exc:
            # The external effect happened but its local record could not be written: the lease
            # will expire and the sweeper parks it as unknown for reconciliation.
            raise store._unavailable("complete", exc, scope) from exc
