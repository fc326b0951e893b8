"""One engine for the claim: each atomic phase of the two execution modes, written once.

:func:`~consumer_idem.execution.run_transactional` and the HTTP middleware
(:mod:`consumer_idem.http`) drive :class:`TransactionalClaim`; the middleware's two-phase routes
drive :class:`TwoPhaseClaim`. These objects own the transaction and the record's state change,
so a fix to either lands in one place. Every COMMIT they rely on is an explicit ``COMMIT`` whose
tag is checked (:mod:`consumer_idem.commit`): a transaction the work aborted (an error caught
without a savepoint) answers ``ROLLBACK``, and that is a failure, never a completed record.

Transactional: claim, the work on the claim's connection, completion and COMMIT are one
transaction::

    async with TransactionalClaim(store, conn, scope, key, fingerprint) as claim:
        if claim.decision is not None:          # not ours: replay, misuse, in progress, unknown
            return outcome_of(claim.decision)
        try:
            result = await work(conn)           # the work's writes, in the claim's transaction
        except Exception as exc:
            return await claim.fail(exc)        # ROLLBACK, then record why
        return await claim.complete(result)     # result + COMMIT; a refused commit -> fail()

Two-phase: the claim commits with a lease, the I/O runs outside any transaction, the completion
commits in a second transaction with any local writes::

    claim = TwoPhaseClaim(store, scope, key, fingerprint, lease=30)
    decision = await claim.reserve()            # execute (claim.attempt), or someone else's
    ... result = await charge(claim.attempt.downstream_key) ...
    return await claim.complete(result, writes=[...])   # or fail_retryable(exc) / park(exc)

Waiting for another owner (opt-in; HTTP ``wait=``): :func:`waiters_for` gives the store's
:class:`CompletionWaiters`. While any request waits, one pooled connection LISTENs; the
transaction that settles a key NOTIFYs in its own COMMIT (only where waiting is enabled:
``notify=True``), so a waiter neither polls the database hard nor holds a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

import asyncpg

from consumer_idem import tracing
from consumer_idem.commit import (
    Rider,
    check_gone,
    commit,
    execute_and_commit,
    mark_lost,
    new_mark,
    rollback,
)
from consumer_idem.errors import (
    Ambiguous,
    CommitRolledBack,
    ConsumerIdemError,
    DomainError,
    KeyInFlight,
    LeaseLost,
    PoisonMessage,
    StoreRejected,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.outbox import UnitOutbox, close_units, committed, open_unit
from consumer_idem.outbox_unit import lost_messages
from consumer_idem.stores.base import Store
from consumer_idem.stores.postgres.errors import is_database_outage, wrong_node
from consumer_idem.stores.postgres.migrate import per_schema_name
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.stores.results import encode_result
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

T = TypeVar("T")

#: a local write of a two-phase completion, run in the completion's transaction
Write = Callable[[asyncpg.Connection], Awaitable[Any]]

_UNSET: Any = object()


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


def failed_outcome(
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


def error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{code or type(exc).__name__}: {exc}"[:500]


class _Refused(Exception):
    """The transaction did not commit, and not because the store is down: the server answered
    COMMIT with an error (a deferred constraint, a serialization failure) or with ``ROLLBACK``
    (the work had aborted the transaction: an error caught without a savepoint), or a statement
    of the completion found the transaction aborted. Nothing was committed: a work failure."""


async def _commit(store: PostgresStore, conn: Any, scope: str, commit: Awaitable[T]) -> T:
    """Await ``commit`` (a completion ending in a checked COMMIT) and classify its failure:
    :class:`_Refused` when the server did not commit, the store's error when it is down."""
    try:
        return await commit
    except (CommitRolledBack, StoreRejected) as exc:
        # StoreRejected here: a completion statement met the transaction the work aborted
        raise _Refused(str(exc)) from exc
    except ConsumerIdemError:
        raise  # classified already (StoreUnavailable, LeaseLost)
    except asyncpg.InFailedSQLTransactionError:
        # the completion met a transaction the work had aborted: the same as COMMIT -> ROLLBACK
        aborted = CommitRolledBack(
            "the transaction had been aborted (a statement failed inside it and the work went "
            "on): nothing was committed"
        )
        raise _Refused(str(aborted)) from aborted
    except asyncpg.PostgresError as exc:
        if (
            isinstance(exc, asyncpg.PostgresConnectionError)
            or conn.is_closed()
            or wrong_node(exc)  # a server that cannot take writes: nothing of the work's doing
        ):
            raise store.error_for("commit", exc, scope, conn) from exc
        raise _Refused(str(exc)) from exc
    except Exception as exc:
        # The commit may or may not have reached the server; both outcomes are atomic
        # (row and effect together), so the redelivery settles it: replay or execute.
        raise store.error_for("commit", exc, scope) from exc


def _outage(store: PostgresStore, exc: BaseException) -> bool:
    """``exc``, met while the work's local writes ran with the completion, is one to wait out:
    for a driver error, as for a handler's own statement (:func:`is_database_outage`: its
    syntax error is its own failure); for anything else, as the store sees it."""
    if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
        return is_database_outage(exc)
    return store.is_outage(exc)


def _closed(conn: Any) -> bool:
    """The claim's connection is gone (an OSError then came from it, not from the work's own
    calls elsewhere, such as an HTTP request to another service)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:  # taken back by the pool after the server killed it
        return True


def _transaction_gone(conn: Any) -> bool:
    """Our transaction is gone although the connection is alive: the work ended it."""
    try:
        return not conn.is_closed() and not conn.is_in_transaction()
    except asyncpg.InterfaceError:
        # a pooled connection the pool took back (terminated under us): not alive, so not
        # ended by the work; the next statement on it reports the outage
        return False


def is_lock_timeout(exc: BaseException) -> bool:
    """Did ``exc`` come from a lock wait that ran out (``lock_timeout``)? Then another
    transaction holds the key's row right now: the work is in flight, the store is not down."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyInFlight | asyncpg.LockNotAvailableError):
            return True
        seen = seen.__cause__
    return False


class TransactionalClaim:
    """The transactional atomic phase on ``conn`` (a connection not in a transaction).

    Entering it BEGINs and claims the key in one round trip (a key that has a row goes through
    :meth:`PostgresStore.reserve` in the same transaction). ``decision`` is then ``None`` when
    this phase owns the key, else the reservation's answer (its transaction is already
    committed). Leaving it with an exception, or without :meth:`complete` / :meth:`fail`, rolls
    back: nothing of the attempt stays.

    ``lock_timeout_ms`` bounds the wait for a concurrent claim of the same key: its expiry (at
    the claim, or inside the reservation) raises :class:`KeyInFlight`. ``domain_errors``: a
    :class:`DomainError` passed to :meth:`fail` is stored as a completed result (consumers) or
    is a plain failure (HTTP stores its 4xx responses instead). ``notify``: settle with a NOTIFY
    for :class:`CompletionWaiters`.
    """

    def __init__(
        self,
        store: PostgresStore,
        conn: asyncpg.Connection,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        retention: timedelta | float | None = None,
        lock_timeout_ms: int | None = None,
        domain_errors: bool = True,
        notify: bool = False,
        rider: Rider | None = None,
    ) -> None:
        self.store = store
        self.conn = conn
        self.scope = scope
        self.key = key
        self.fingerprint = fingerprint
        self.retention = retention
        self.lock_timeout_ms = lock_timeout_ms
        self.domain_errors = domain_errors
        self.notify = notify
        #: a caller's statement committed with the completion (only with it: not with a
        #: failure or a domain error, recorded in a transaction of their own)
        self.rider = rider
        #: None: this phase owns the key; otherwise what the reservation decided
        self.decision: Decision | None = None
        #: the owner token when the key was re-acquired (``None`` for a fresh claim)
        self.token: UUID | None = None
        self.attempts = 1
        #: the transaction-local mark its COMMIT checks (see ``consumer_idem.commit``); set on
        #: entry: a transaction begun ahead brings its own
        self.mark = ""
        #: how the phase ended, once it has
        self.outcome: Outcome | None = None
        #: the unit's outbox (``outbox_for(conn)``) while this phase owns the key
        self.outbox: UnitOutbox | None = None

    @tracing.traced("reserve")
    async def __aenter__(self) -> TransactionalClaim:
        store, conn = self.store, self.conn
        try:
            ahead = None
            if self.lock_timeout_ms is None:  # begun with the previous unit's COMMIT?
                ahead = store.fast_path.take_ahead(
                    conn, self.scope, self.key, self.fingerprint, self.retention
                )
            if ahead is not None:
                self.mark, claimed = ahead.mark, ahead.claimed
            else:
                self.mark = new_mark()
                claimed = await store.fast_path.begin_and_claim(
                    conn,
                    self.scope,
                    self.key,
                    self.fingerprint,
                    self.retention,
                    self.lock_timeout_ms,
                    mark=self.mark,
                )
            if not claimed:
                decision = await store.reserve(
                    self.scope, self.key, self.fingerprint, retention=self.retention, conn=conn
                )
                if decision.kind is DecisionKind.EXECUTE:
                    self.token, self.attempts = decision.token, decision.record.attempts
                else:
                    # not ours; the reservation may have parked an expired lease: keep that
                    await _commit(store, conn, self.scope, commit(conn))
                    self.decision = decision
        except BaseException as exc:
            await rollback(conn)
            if self.lock_timeout_ms is not None and is_lock_timeout(exc):
                raise KeyInFlight(f"({self.scope!r}, {self.key!r}) is held right now") from exc
            raise
        if self.decision is None:  # ours: what the work publishes commits with it
            self.outbox = open_unit(conn, self.scope, self.key, store)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.outbox is not None:
            close_units(self.conn)
        if self.outcome is None and self.decision is None:
            await rollback(self.conn)  # never leave our transaction open

    @tracing.traced("commit")
    async def complete(
        self,
        result: Any = None,
        *,
        encoded: Any = _UNSET,
        response: StoredResponse | None = None,
    ) -> Outcome:
        """Store ``result`` (``encoded``: its :func:`encode_result`, when already computed) and
        ``response``, then COMMIT, checking that Postgres committed. When it did not (the work
        aborted the transaction, a deferred constraint or a serialization failure refused the
        commit) the attempt is rolled back and recorded by :meth:`fail`: the outcome is then
        ``failed_retryable``, never ``executed``, and nothing is cached."""
        store, conn, scope, key = self.store, self.conn, self.scope, self.key
        if _transaction_gone(conn):
            return await self._ended_by_work(None)
        if encoded is _UNSET:
            encoded = encode_result(result)
        outgoing = self.outbox.messages if self.outbox is not None else []
        notify = notify_sql(store, scope, key) if self.notify else ""
        rider = self.rider.sql if self.rider is not None else ""
        record: Record | None = None
        try:
            # the work's outgoing messages: a few ride in the COMMIT's query (after its
            # transaction check), many are copied just before it
            insert = await _commit(store, conn, scope, store.outbox.stage(conn, outgoing))
            then = "; ".join(s for s in (insert, notify, rider) if s)
            if self.token is None:
                finish = store.fast_path.finish_claimed(
                    conn,
                    scope,
                    key,
                    encoded=encoded,
                    response=response,
                    then=then,
                    mark=self.mark,
                )
                await _commit(store, conn, scope, finish)
            else:
                owned = self._complete_owned(result, response, then)
                record = await _commit(store, conn, scope, owned)
        except LeaseLost as lost:
            # Our transaction holds the re-acquired row's lock, so no one else can have changed
            # it: the work rolled the transaction back (and began another). Nothing commits.
            await rollback(conn)
            ended = CommitRolledBack(
                "the handler ended the idempotency transaction itself (COMMIT or ROLLBACK on "
                "its connection): its claim is gone"
            )
            ended.__cause__ = lost
            return await self.fail(ended, _our_commit=True)
        except _Refused as refused:
            # the check did not run when a prepared statement had gone (a handler's DEALLOCATE):
            # as unsure as a lost mark, whether the work committed our claim
            gone = check_gone(refused)
            unsure = mark_lost(refused) or gone
            claim = await self._claim_committed_by_work() if unsure else None
            if gone:
                await store.fast_path.heal(conn)
            if claim is not None:
                # COMMIT; BEGIN in the work: our claim (and what the work wrote before) is
                # durable, the rest is rolled back here. Not a failure to retry: never again.
                return await self._ended_by_work(refused.__cause__ or refused, claim)
            log.warning(
                "scope=%s key=%s: the commit did not happen (%s): the attempt is a failure",
                scope,
                key,
                refused,
                extra={"scope": scope, "key": key},
            )
            # a check a handler deallocated is the work's doing, not a pooler's: never an outage
            cause = refused if gone else (refused.__cause__ or refused)
            return await self.fail(cause, _our_commit=True)
        if store.cache is not None:  # committed: safe to cache
            cached = record or store.fast_path.completed_record(
                scope, key, self.fingerprint, encoded, self.retention
            )
            if record is None and response is not None:
                cached = replace(cached, response=response)
            await store.remember(cached)
        if self.rider is not None:
            self.rider.committed()
        self.outcome = Outcome(
            kind=OutcomeKind.EXECUTED,
            scope=scope,
            key=key,
            result=result,
            result_kind=ResultKind.SUCCESS,
            record=record,
            attempts=self.attempts,
        )
        committed(store, outgoing)  # sent now by this process (or, failing that, a relay)
        return self.outcome

    async def _claim_committed_by_work(self) -> Record | None:
        """After a lost transaction mark: our claim row if a COMMIT of the work's committed it
        (then the work may have durable effects), None if the claim went with a ROLLBACK (then
        nothing of the attempt is left, and it is an ordinary failure to retry)."""
        await rollback(self.conn)  # the transaction the work began is aborted: end it
        record = await self.store.get(self.scope, self.key)
        if record is None:
            return None
        if self.token is None:
            # our INSERT claimed the key: a completed row with our payload is ours, or the
            # work of a duplicate that committed once the work's ROLLBACK freed the key (done
            # either way). Another payload's is not: this message then meets it as a misuse.
            ours = record.status is Status.COMPLETED and record.fingerprint == self.fingerprint
        else:
            ours = record.status is Status.IN_PROGRESS and record.owner_token == self.token
        return record if ours else None

    async def _ended_by_work(
        self, exc: BaseException | None, committed: Record | None = None
    ) -> Outcome:
        """The work sent COMMIT or ROLLBACK on the claim's connection itself. What it wrote
        before, and what it wrote after in autocommit, may be durable without the record that
        guards it: it must never run again. Unless its COMMIT took our completed claim row with
        it (then the record says so), the key is parked as ``unknown`` for reconciliation.
        ``committed``: our claim row, already read, when the work's COMMIT is known to have
        committed it."""
        scope, key = self.scope, self.key
        log.error(
            "scope=%s key=%s: the work ended the idempotency transaction itself (COMMIT or "
            "ROLLBACK on the claim's connection): parking the key as unknown; never end it in "
            "a handler",
            scope,
            key,
            extra={"scope": scope, "key": key},
        )
        why = "the handler ended the idempotency transaction itself"
        record = committed or await self.store.fast_path.record_failure(
            scope, key, self.fingerprint, "unknown", why, retention=self.retention, conn=self.conn
        )
        if record is None:  # its COMMIT committed our claim: that record is the truth
            record = await self.store.get(scope, key)
        if (
            record is not None
            and self.token is not None
            and record.status is Status.IN_PROGRESS
            and record.owner_token == self.token
        ):  # our re-acquired lease, committed by the work: park it now, not at expiry
            record = await self.store.mark_unknown(scope, key, self.token, why)
        lost = lost_messages(self.outbox)
        if lost is not None:  # never a success: what it published is gone
            log.error("scope=%s key=%s: %s", scope, key, lost, extra={"scope": scope, "key": key})
            self.store.metrics.inc("outbox_lost", scope, len(lost.messages))
            self.outcome = failed_outcome(record, scope, key, lost, OutcomeKind.UNKNOWN, True)
            return self.outcome
        if record is not None and record.status is Status.COMPLETED:
            self.outcome = Outcome(
                OutcomeKind.REPLAYED, scope, key, record.result, record.result_kind, record
            )
            return self.outcome
        error = exc or CommitRolledBack(why)
        self.outcome = failed_outcome(record, scope, key, error, OutcomeKind.UNKNOWN, True)
        return self.outcome

    async def _complete_owned(
        self, result: Any, response: StoredResponse | None, then: str
    ) -> Record:
        assert self.token is not None
        record = await self.store.complete(
            self.scope,
            self.key,
            self.token,
            result,
            response=response,
            retention=self.retention,
            conn=self.conn,
        )
        check = self.store.fast_path.check(self.mark)  # prepared by begin_and_claim
        if then:  # the outbox's INSERT, a NOTIFY
            check += "; " + then
        await execute_and_commit(self.conn, check)
        return record

    @tracing.traced("commit")
    async def fail(
        self, exc: BaseException, error: str | None = None, *, _our_commit: bool = False
    ) -> Outcome:
        """ROLLBACK (nothing of the attempt stays), then record why on the same connection:
        :class:`Ambiguous` -> ``unknown``; a :class:`DomainError` (with ``domain_errors``) ->
        ``completed`` with its result; anything else -> ``failed_retryable``, which the next
        attempt re-acquires. ``error`` overrides the text stored as ``last_error``. A
        cancellation is re-raised once rolled back (the redelivery runs it). Idempotent."""
        if self.outcome is not None:
            return self.outcome
        store, conn, scope, key = self.store, self.conn, self.scope, self.key
        # no transaction left: the work ended it, unless it was our own refused COMMIT
        ended = not _our_commit and _transaction_gone(conn)
        await rollback(conn)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if ended:
            return await self._ended_by_work(exc)
        if is_database_outage(exc) or (isinstance(exc, OSError) and _closed(conn)):
            # the work's own statement met an outage or a transient refusal (lock timeout,
            # statement timeout, deadlock, serialization failure, a dropped connection): nothing
            # committed and no handler bug: wait for the store, without spending an attempt
            raise store.error_for("handler statement", exc, scope, conn) from exc
        if self.domain_errors and isinstance(exc, DomainError):
            self.outcome = await self._domain_error(exc)
            return self.outcome
        if isinstance(exc, PoisonMessage):
            # Nothing is recorded: the key stays as it was (free, for a new one), so a corrected
            # copy with another payload can run. The consumer logs and dead-letters it.
            log.debug(
                "scope=%s key=%s: poison message rolled back: %r",
                scope,
                key,
                exc,
                extra={"scope": scope, "key": key},
            )
            self.outcome = failed_outcome(None, scope, key, exc, OutcomeKind.FAILED_RETRYABLE)
            return self.outcome
        status = "unknown" if isinstance(exc, Ambiguous) else "failed_retryable"
        log.warning(
            "scope=%s key=%s: transactional work failed, rolled back and recorded as %s: %r",
            scope,
            key,
            status,
            exc,
            extra={"scope": scope, "key": key},
        )
        record = await store.fast_path.record_failure(
            scope,
            key,
            self.fingerprint,
            status,
            error or error_code(exc),
            retention=self.retention,
            conn=conn,
        )
        kind = OutcomeKind.UNKNOWN if status == "unknown" else OutcomeKind.FAILED_RETRYABLE
        self.outcome = failed_outcome(
            record, scope, key, exc, kind, parked_now=kind is OutcomeKind.UNKNOWN
        )
        if self.notify:  # a waiter may run it now (or learn it is unknown)
            await _notify(store, scope, key, conn)
        return self.outcome

    async def _domain_error(self, exc: DomainError) -> Outcome:
        store, scope, key = self.store, self.scope, self.key
        record = await store.fast_path.complete_new(
            scope,
            key,
            self.fingerprint,
            exc.result,
            ResultKind.DOMAIN_ERROR,
            retention=self.retention,
            conn=self.conn,
        )
        if record is None:  # someone else holds the key now: report what they have
            decision = await store.reserve(
                scope, key, self.fingerprint, retention=self.retention, conn=self.conn
            )
            if decision.kind is not DecisionKind.EXECUTE:
                return outcome_of(decision)
            # Nobody does: the key was `expired` (soft-pruned), which the rollback of our claim
            # restored, and the reservation has just re-acquired it for us. Its lease is ours:
            # complete it with our result, or it would sit in progress until the sweeper parks
            # it as unknown.
            assert decision.token is not None
            record = await store.complete(
                scope,
                key,
                decision.token,
                exc.result,
                result_kind=ResultKind.DOMAIN_ERROR,
                retention=self.retention,
                conn=self.conn,
            )
        return Outcome(
            kind=OutcomeKind.EXECUTED,
            scope=scope,
            key=key,
            result=exc.result,
            result_kind=ResultKind.DOMAIN_ERROR,
            record=record,
            attempts=record.attempts,
        )


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

    Phase one, :meth:`reserve`, commits the claim with a lease. The work then runs outside any
    transaction (``attempt.downstream_key`` goes to the far side). Phase two settles it:
    :meth:`complete` (local ``writes``, the result and an HTTP response in one transaction with a
    checked COMMIT), :meth:`fail_retryable` (provably not executed) or :meth:`park` (may have
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

    @tracing.traced("reserve")
    async def reserve(self) -> Decision:
        """Phase one: ``execute`` (this attempt owns the key: see ``attempt``) or the answer
        for someone else's key (replay, misuse, in progress, unknown)."""
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

    @tracing.traced("commit")
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
        :class:`StoreUnavailable`; the record keeps its lease, and the sweeper parks it when
        the lease runs out. Never re-run."""
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
                if not isinstance(exc, StoreRejected) and _outage(store, exc):
                    raise store.error_for("complete", exc, self.scope, conn) from exc
                raise _NotCompleted(f"{type(exc).__name__}: {exc}") from exc
            except BaseException:
                await rollback(conn)
                raise
        await store.remember(record)  # committed now
        return record

    @tracing.traced("commit")
    async def fail_retryable(self, exc: BaseException) -> Outcome:
        """The work provably did not happen: the next attempt may re-acquire the key."""
        try:
            record = await self.store.fail_retryable(
                self.scope, self.key, self._token(), error_code(exc)
            )
        except LeaseLost as lost:
            return await self._fenced(lost, ran=False)
        await self._wake()
        return failed_outcome(record, self.scope, self.key, exc, OutcomeKind.FAILED_RETRYABLE)

    @tracing.traced("commit")
    async def poison(self, exc: PoisonMessage) -> Outcome:
        """The work refused the message as one it can never process (raised before any
        external call): the key is left as the attempt found it, as a rolled-back transactional
        attempt leaves it. Free again after a first attempt, so a corrected copy can run;
        ``failed_retryable`` after earlier ones. The consumer dead-letters the delivery."""
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

    @tracing.traced("commit")
    async def park(self, exc: BaseException) -> Outcome:
        """The work may have had its effect: park the record as ``unknown`` for reconciliation
        (shielded from cancellation; a cancellation is re-raised once the record is safe)."""
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
            await _notify(self.store, self.scope, self.key)


# --- waiting for another owner ---------------------------------------------------------------


def _digest(scope: str, key: str) -> str:
    return hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()[:32]


def _channel(store: PostgresStore) -> str:
    # within Postgres' 63 bytes, and one of its own for each schema
    return per_schema_name("consumer_idem_done", store.schema)


def notify_sql(store: PostgresStore, scope: str, key: str) -> str:
    """The NOTIFY that tells waiters (scope, key) was settled. Sent inside the settling
    transaction it is delivered at COMMIT, and never if the transaction rolls back."""
    return f"NOTIFY \"{_channel(store)}\", '{_digest(scope, key)}'"


async def _notify(store: PostgresStore, scope: str, key: str, conn: Any = None) -> None:
    """Best effort, after a failure was recorded: a missed one costs a waiter a poll."""
    try:
        async with store.connection(conn) as c:
            await c.execute(notify_sql(store, scope, key))
    except Exception:
        log.debug("notifying waiters failed", exc_info=True, extra={"scope": scope, "key": key})


class CompletionWaiters:
    """Requests of one process waiting for another owner of their key, on one store.

    While at least one waits, one pooled connection LISTENs on the store's channel (and goes
    back to the pool when the last waiter leaves). A waiter registers before it checks the
    record again, so a settlement between the check and the wait is not missed. Settlements
    notify only where waiting is enabled (a NOTIFY makes commits queue on a lock for a moment),
    so a waiter also re-checks now and then.

    Behind a transaction pooler (``pooler="transaction"``) nobody listens: a LISTEN needs one
    server connection for as long as it lasts. Waiters then only re-check, more often
    (:attr:`poll_cap`).
    """

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.channel = _channel(store)
        #: whether settlements wake waiters (LISTEN), or waiters only poll
        self.listening = store.pooler != "transaction"
        #: the longest pause between two re-checks of a waiter (seconds)
        self.poll_cap = 2.0 if self.listening else 0.2
        self._events: dict[str, set[asyncio.Event]] = {}
        self._conn: Any = None
        self._users = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def watch(self, scope: str, key: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever (scope, key) is settled, while the block runs."""
        digest = _digest(scope, key)
        event = asyncio.Event()
        self._events.setdefault(digest, set()).add(event)
        listening = False
        try:
            if self.listening:
                await self._listen()
                listening = True
            yield event
        finally:
            events = self._events.get(digest)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._events[digest]
            if listening:
                await self._unlisten()

    def _notified(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        for event in self._events.get(str(payload), ()):
            event.set()

    async def _listen(self) -> None:
        async with self._lock:
            if self._conn is not None and self._conn.is_closed():
                await self._release()  # the listener's connection broke: listen anew
            if self._conn is None:
                store = self.store
                try:
                    conn = await store.pool.acquire(timeout=store.command_timeout)
                except Exception as exc:
                    raise store.error_for("listen", exc) from exc
                try:
                    await conn.add_listener(self.channel, self._notified)
                except Exception as exc:
                    await store.pool.release(conn)
                    raise store.error_for("listen", exc) from exc
                self._conn = conn
            self._users += 1

    async def _unlisten(self) -> None:
        async with self._lock:
            self._users -= 1
            if self._users == 0:
                await self._release()

    async def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed():
                await conn.remove_listener(self.channel, self._notified)
        except Exception:
            log.debug("UNLISTEN failed", exc_info=True)
        finally:
            await self.store.pool.release(conn)


_waiters: weakref.WeakKeyDictionary[PostgresStore, CompletionWaiters] = weakref.WeakKeyDictionary()


def waiters_for(store: PostgresStore) -> CompletionWaiters:
    """The store's waiters (one listening connection per store and process)."""
    waiters = _waiters.get(store)
    if waiters is None:
        waiters = _waiters[store] = CompletionWaiters(store)
    return waiters
