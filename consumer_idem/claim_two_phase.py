"""The two-phase atomic phase: the claim commits with a lease, the I/O runs outside any
transaction, the completion commits in a second transaction with any local writes (see
`consumer_idem.claim`). Re-exported from ``consumer_idem.claim``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

import asyncpg

from consumer_idem import tracing
from consumer_idem.attempt import Attempt, error_code, failed_outcome
from consumer_idem.claim_commit import work_outage
from consumer_idem.commit import commit, execute_and_commit, rollback
from consumer_idem.completion_waiters import notify_settled, notify_sql
from consumer_idem.errors import (
    LeaseLost,
    PoisonMessage,
    StoreRejected,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.stores.base import Store
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Outcome,
    OutcomeKind,
    Record,
    ResultKind,
    Status,
    StoredResponse,
)

log = logging.getLogger("consumer_idem.claim")

#: a local write of a two-phase completion, run in the completion's transaction
Write = Callable[[asyncpg.Connection], Awaitable[Any]]


class _NotCompleted(Exception):
    """The two-phase work succeeded but its completion could not be committed for a reason
    waiting will not cure: the effect happened, its record did not."""


#: what a fenced-out two-phase attempt reports, by the state the record is in now
_NOW = {
    Status.COMPLETED: OutcomeKind.REPLAYED,
    Status.IN_PROGRESS: OutcomeKind.IN_PROGRESS,
    Status.UNKNOWN: OutcomeKind.UNKNOWN,
    Status.EXPIRED: OutcomeKind.UNKNOWN,
    Status.FAILED_RETRYABLE: OutcomeKind.FAILED_RETRYABLE,
}


class TwoPhaseClaim:
    """The two atomic phases around external I/O, for one attempt of (scope, key).

    Phase one, `reserve`, commits the claim with a lease. The work then runs outside any
    transaction (``attempt.downstream_key`` goes to the far side). Phase two settles it:
    `complete` (local ``writes``, the result and an HTTP response in one transaction with a
    checked COMMIT), `fail_retryable` (provably not executed) or `park` (may have
    executed: ``unknown``). Every write is fenced by the owner token: when the lease was lost,
    the outcome is what the record says now, and this attempt reports nothing of its own.
    """

    def __init__(
        self,
        store: Store,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        lease: timedelta | float | None = None,
        retention: timedelta | float | None = None,
        notify: bool = False,
    ) -> None:
        self.store = store
        self.scope = scope
        self.key = key
        self.fingerprint = fingerprint
        self.lease = lease
        self.retention = retention
        self.notify = notify
        self.token: UUID | None = None
        #: set when :meth:`reserve` granted execution
        self.attempt: Attempt | None = None

    async def reserve(self) -> Decision:
        """Phase one: ``execute`` (this attempt owns the key: see ``attempt``) or the answer
        for someone else's key (replay, misuse, in progress, unknown)."""
        with tracing.step("reserve") as span:
            done = await self._reserve_step()
            span.describe(done)
            return done

    async def _reserve_step(self) -> Decision:
        decision = await self.store.reserve(
            self.scope, self.key, self.fingerprint, lease=self.lease, retention=self.retention
        )
        if decision.kind is DecisionKind.EXECUTE:
            assert decision.token is not None
            self.token = decision.token
            self.attempt = Attempt(self.scope, self.key, decision.token, decision.record.attempts)
        return decision

    def _token(self) -> UUID:
        if self.token is None:
            raise RuntimeError("this attempt does not own the key: reserve() did not execute")
        return self.token

    async def complete(
        self,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        response: StoredResponse | None = None,
        writes: Sequence[Write] = (),
    ) -> Outcome:
        """Phase two: ``writes``, the completion and a checked COMMIT in one transaction.

        A completion that cannot be committed for a reason waiting will not cure (a write
        failed or aborted the transaction, the result cannot be stored) parks the record as
        ``unknown``: the external effect happened, its local record did not. An outage raises
        [`StoreUnavailable`][consumer_idem.StoreUnavailable]; the record keeps its lease, and the
        sweeper parks it when
        the lease runs out. Never re-run."""
        with tracing.step("commit") as span:
            done = await self._complete_step(
                result, result_kind=result_kind, response=response, writes=writes
            )
            span.describe(done)
            return done

    async def _complete_step(
        self,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        response: StoredResponse | None = None,
        writes: Sequence[Write] = (),
    ) -> Outcome:
        token = self._token()
        store = self.store
        try:
            if writes or response is not None or self.notify:
                record = await self._complete_in_transaction(
                    token, result, result_kind, response, writes
                )
            else:
                record = await store.complete(
                    self.scope,
                    self.key,
                    token,
                    result,
                    result_kind=result_kind,
                    retention=self.retention,
                )
        except LeaseLost as lost:
            return await self._fenced(lost)
        except _NotCompleted as failed:
            return await self.park(failed.__cause__ or failed)
        except (UnstorableResult, StoreRejected) as exc:
            return await self.park(exc)
        return Outcome(
            kind=OutcomeKind.EXECUTED,
            scope=self.scope,
            key=self.key,
            result=result,
            result_kind=result_kind,
            record=record,
            attempts=record.attempts,
        )

    async def _complete_in_transaction(
        self,
        token: UUID,
        result: Any,
        result_kind: ResultKind,
        response: StoredResponse | None,
        writes: Sequence[Write],
    ) -> Record:
        store = self.store
        if not isinstance(store, PostgresStore):
            raise TypeError("local writes and stored responses need the Postgres store")
        async with store.connection() as conn:
            # explicit BEGIN and a checked COMMIT: asyncpg's transaction() commits an aborted
            # transaction (a write that swallowed an error) without a word
            try:
                await conn.execute("BEGIN")
                for write in writes:
                    await write(conn)
                record = await store.complete(
                    self.scope,
                    self.key,
                    token,
                    result,
                    result_kind=result_kind,
                    response=response,
                    retention=self.retention,
                    conn=conn,
                )
                if self.notify:
                    await execute_and_commit(conn, notify_sql(store, self.scope, self.key))
                else:
                    await commit(conn)
            except (LeaseLost, StoreUnavailable):
                await rollback(conn)
                raise
            except Exception as exc:
                await rollback(conn)
                if not isinstance(exc, StoreRejected) and work_outage(store, exc):
                    raise store.error_for("complete", exc, self.scope, conn) from exc
                raise _NotCompleted(f"{type(exc).__name__}: {exc}") from exc
            except BaseException:
                await rollback(conn)
                raise
        await store.remember(record)  # committed now
        return record

    async def fail_retryable(self, exc: BaseException) -> Outcome:
        """The work provably did not happen: the next attempt may re-acquire the key."""
        with tracing.step("commit") as span:
            done = await self._fail_retryable_step(exc)
            span.describe(done)
            return done

    async def _fail_retryable_step(self, exc: BaseException) -> Outcome:
        try:
            record = await self.store.fail_retryable(
                self.scope, self.key, self._token(), error_code(exc)
            )
        except LeaseLost as lost:
            return await self._fenced(lost, ran=False)
        await self._wake()
        return failed_outcome(record, self.scope, self.key, exc, OutcomeKind.FAILED_RETRYABLE)

    async def poison(self, exc: PoisonMessage) -> Outcome:
        """The work refused the message as one it can never process (raised before any
        external call): the key is left as the attempt found it, as a rolled-back transactional
        attempt leaves it. Free again after a first attempt, so a corrected copy can run;
        ``failed_retryable`` after earlier ones. The consumer dead-letters the delivery."""
        with tracing.step("commit") as span:
            done = await self._poison_step(exc)
            span.describe(done)
            return done

    async def _poison_step(self, exc: PoisonMessage) -> Outcome:
        try:
            record: Record | None = None
            if self.attempt is not None and self.attempt.number <= 1:
                await self.store.evict(self.scope, self.key, token=self._token())
            else:
                record = await self.store.fail_retryable(
                    self.scope, self.key, self._token(), error_code(exc)
                )
        except LeaseLost as lost:
            return await self._fenced(lost, ran=False)
        await self._wake()
        return failed_outcome(record, self.scope, self.key, exc, OutcomeKind.FAILED_RETRYABLE)

    async def park(self, exc: BaseException) -> Outcome:
        """The work may have had its effect: park the record as ``unknown`` for reconciliation
        (shielded from cancellation; a cancellation is re-raised once the record is safe)."""
        with tracing.step("commit") as span:
            done = await self._park_step(exc)
            span.describe(done)
            return done

    async def _park_step(self, exc: BaseException) -> Outcome:
        try:
            record = await asyncio.shield(
                self.store.mark_unknown(self.scope, self.key, self._token(), error_code(exc))
            )
        except LeaseLost as lost:  # the lease ran out and the record was parked or settled
            return await self._fenced(lost)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        await self._wake()
        return failed_outcome(
            record, self.scope, self.key, exc, OutcomeKind.UNKNOWN, parked_now=True
        )

    async def _fenced(self, lost: LeaseLost, ran: bool = True) -> Outcome:
        """The record, not this attempt, decides. Gone (an operator evicted it): if the work
        provably did not run (``ran=False``), the next attempt decides again; if it ran or may
        have, it must never run again, so the record is written back as ``unknown`` (with a
        notice) where the store can, and the delivery is settled as ``unknown`` either way."""
        record = await self.store.get(self.scope, self.key)
        parked_now = False
        if record is None and ran:
            fast_path = getattr(self.store, "fast_path", None)  # Postgres only
            record_failure = None if fast_path is None else fast_path.record_failure
            if record_failure is not None:
                record = await record_failure(
                    self.scope,
                    self.key,
                    self.fingerprint,
                    "unknown",
                    f"evicted while its work ran: {lost}"[:500],
                    retention=self.retention,
                )
                parked_now = record is not None
            kind = OutcomeKind.UNKNOWN
        else:
            kind = OutcomeKind.FAILED_RETRYABLE if record is None else _NOW[record.status]
        log.warning(
            "scope=%s key=%s: lease lost (%s): the record is %s",
            self.scope,
            self.key,
            lost,
            "gone" if record is None else record.status,
            extra={"scope": self.scope, "key": self.key},
        )
        return Outcome(
            kind=kind,
            scope=self.scope,
            key=self.key,
            result=record.result if kind is OutcomeKind.REPLAYED and record else None,
            result_kind=record.result_kind if record else None,
            record=record,
            error=lost,
            attempts=0,  # not this attempt's count: a fenced attempt never exhausts a budget
            parked_now=parked_now,
        )

    async def _wake(self) -> None:
        if self.notify and isinstance(self.store, PostgresStore):
            await notify_settled(self.store, self.scope, self.key)


# --- waiting for another owner ---------------------------------------------------------------
