"""One engine for the claim: each atomic phase of the two execution modes, written once.

[`run_transactional`][consumer_idem.execution.run_transactional] and the HTTP middleware
(`consumer_idem.http`) drive `TransactionalClaim`; the middleware's two-phase routes
drive `TwoPhaseClaim`. These objects own the transaction and the record's state change,
so a fix to either lands in one place. Every COMMIT they rely on is an explicit ``COMMIT`` whose
tag is checked (`consumer_idem.commit`): a transaction the work aborted (an error caught
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

Waiting for another owner (opt-in; HTTP ``wait=``): `waiters_for` gives the store's
`CompletionWaiters`. While any request waits, one pooled connection LISTENs; the
transaction that settles a key NOTIFYs in its own COMMIT (only where waiting is enabled:
``notify=True``), so a waiter neither polls the database hard nor holds a connection.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from datetime import timedelta
from typing import Any
from uuid import UUID

import asyncpg

from consumer_idem import tracing
from consumer_idem.attempt import Attempt as Attempt
from consumer_idem.attempt import error_code as error_code
from consumer_idem.attempt import failed_outcome as failed_outcome
from consumer_idem.attempt import outcome_of as outcome_of
from consumer_idem.claim_commit import (
    Refused,
    checked_commit,
    conn_closed,
    transaction_gone,
)
from consumer_idem.claim_commit import is_lock_timeout as is_lock_timeout
from consumer_idem.claim_two_phase import TwoPhaseClaim as TwoPhaseClaim
from consumer_idem.claim_two_phase import Write as Write
from consumer_idem.commit import (
    Rider,
    check_gone,
    commit,
    execute_and_commit,
    mark_lost,
    new_mark,
    rollback,
)
from consumer_idem.completion_waiters import CompletionWaiters as CompletionWaiters
from consumer_idem.completion_waiters import notify_settled
from consumer_idem.completion_waiters import notify_sql as notify_sql
from consumer_idem.completion_waiters import waiters_for as waiters_for
from consumer_idem.errors import (
    Ambiguous,
    CommitRolledBack,
    DomainError,
    KeyInFlight,
    LeaseLost,
    PoisonMessage,
)
from consumer_idem.outbox import UnitOutbox, close_units, committed, open_unit
from consumer_idem.outbox_unit import lost_messages
from consumer_idem.stores.postgres.errors import is_database_outage
from consumer_idem.stores.postgres.fast_path import completed_record
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

_UNSET: Any = object()


class TransactionalClaim:
    """The transactional atomic phase on ``conn`` (a connection not in a transaction).

    Entering it BEGINs and claims the key in one round trip (a key that has a row goes through
    [`PostgresStore.reserve`][consumer_idem.PostgresStore.reserve] in the same transaction).
    ``decision`` is then ``None`` when
    this phase owns the key, else the reservation's answer (its transaction is already
    committed). Leaving it with an exception, or without `complete` / `fail`, rolls
    back: nothing of the attempt stays.

    ``lock_timeout_ms`` bounds the wait for a concurrent claim of the same key: its expiry (at
    the claim, or inside the reservation) raises [`KeyInFlight`][consumer_idem.KeyInFlight].
    ``domain_errors``: a
    [`DomainError`][consumer_idem.DomainError] passed to `fail` is stored as a completed result
    (consumers) or
    is a plain failure (HTTP stores its 4xx responses instead). ``notify``: settle with a NOTIFY
    for `CompletionWaiters`.
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

    async def __aenter__(self) -> TransactionalClaim:
        with tracing.step("reserve") as span:
            done = await self._claim()
            span.describe(done)
            return done

    async def _claim(self) -> TransactionalClaim:
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
                    await checked_commit(store, conn, self.scope, commit(conn))
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

    async def complete(
        self,
        result: Any = None,
        *,
        encoded: Any = _UNSET,
        response: StoredResponse | None = None,
    ) -> Outcome:
        """Store ``result`` (``encoded``: its `encode_result`, when already computed) and
        ``response``, then COMMIT, checking that Postgres committed. When it did not (the work
        aborted the transaction, a deferred constraint or a serialization failure refused the
        commit) the attempt is rolled back and recorded by `fail`: the outcome is then
        ``failed_retryable``, never ``executed``, and nothing is cached."""
        with tracing.step("commit") as span:
            outcome = await self._complete(result, encoded, response)
            span.describe(outcome)
            return outcome

    async def _complete(
        self, result: Any, encoded: Any, response: StoredResponse | None
    ) -> Outcome:
        store, scope, key = self.store, self.scope, self.key
        if transaction_gone(self.conn):
            return await self._ended_by_work(None)
        if encoded is _UNSET:
            encoded = encode_result(result)
        outgoing = self.outbox.messages if self.outbox is not None else []
        try:
            record = await self._commit_result(result, encoded, response, outgoing)
        except LeaseLost as lost:
            return await self._lease_lost(lost)
        except Refused as refused:
            return await self._refused(refused)
        if store.cache is not None:  # committed: safe to cache
            cached = record or completed_record(
                store, scope, key, self.fingerprint, encoded, self.retention
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

    async def _commit_result(
        self,
        result: Any,
        encoded: Any,
        response: StoredResponse | None,
        outgoing: list[Any],
    ) -> Record | None:
        """The result, the work's outgoing messages, the rider and a NOTIFY, then the checked
        COMMIT: the record written when this phase re-acquired the key (None for a claim)."""
        store, conn, scope, key = self.store, self.conn, self.scope, self.key
        notify = notify_sql(store, scope, key) if self.notify else ""
        rider = self.rider.sql if self.rider is not None else ""
        # the work's outgoing messages: a few ride in the COMMIT's query (after its
        # transaction check), many are copied just before it
        insert = await checked_commit(store, conn, scope, store.outbox.stage(conn, outgoing))
        then = "; ".join(s for s in (insert, notify, rider) if s)
        if self.token is not None:
            owned = self._complete_owned(result, response, then)
            return await checked_commit(store, conn, scope, owned)
        finish = store.fast_path.finish_claimed(
            conn, scope, key, encoded=encoded, response=response, then=then, mark=self.mark
        )
        await checked_commit(store, conn, scope, finish)
        return None

    async def _lease_lost(self, lost: LeaseLost) -> Outcome:
        # Our transaction holds the re-acquired row's lock, so no one else can have changed
        # it: the work rolled the transaction back (and began another). Nothing commits.
        await rollback(self.conn)
        ended = CommitRolledBack(
            "the handler ended the idempotency transaction itself (COMMIT or ROLLBACK on "
            "its connection): its claim is gone"
        )
        ended.__cause__ = lost
        return await self.fail(ended, _our_commit=True)

    async def _refused(self, refused: Refused) -> Outcome:
        # the check did not run when a prepared statement had gone (a handler's DEALLOCATE):
        # as unsure as a lost mark, whether the work committed our claim
        gone = check_gone(refused)
        unsure = mark_lost(refused) or gone
        claim = await self._claim_committed_by_work() if unsure else None
        if gone:
            await self.store.fast_path.heal(self.conn)
        if claim is not None:
            # COMMIT; BEGIN in the work: our claim (and what the work wrote before) is
            # durable, the rest is rolled back here. Not a failure to retry: never again.
            return await self._ended_by_work(refused.__cause__ or refused, claim)
        log.warning(
            "scope=%s key=%s: the commit did not happen (%s): the attempt is a failure",
            self.scope,
            self.key,
            refused,
            extra={"scope": self.scope, "key": self.key},
        )
        # a check a handler deallocated is the work's doing, not a pooler's: never an outage
        cause = refused if gone else (refused.__cause__ or refused)
        return await self.fail(cause, _our_commit=True)

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

    async def fail(
        self, exc: BaseException, error: str | None = None, *, _our_commit: bool = False
    ) -> Outcome:
        """ROLLBACK (nothing of the attempt stays), then record why on the same connection:
        [`Ambiguous`][consumer_idem.Ambiguous] -> ``unknown``; a
        [`DomainError`][consumer_idem.DomainError] (with ``domain_errors``) ->
        ``completed`` with its result; anything else -> ``failed_retryable``, which the next
        attempt re-acquires. ``error`` overrides the text stored as ``last_error``. A
        cancellation is re-raised once rolled back (the redelivery runs it). Idempotent."""
        with tracing.step("commit") as span:
            done = await self._fail_step(exc, error, _our_commit=_our_commit)
            span.describe(done)
            return done

    async def _fail_step(
        self, exc: BaseException, error: str | None = None, *, _our_commit: bool = False
    ) -> Outcome:
        if self.outcome is not None:
            return self.outcome
        store, conn, scope, key = self.store, self.conn, self.scope, self.key
        # no transaction left: the work ended it, unless it was our own refused COMMIT
        ended = not _our_commit and transaction_gone(conn)
        await rollback(conn)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if ended:
            return await self._ended_by_work(exc)
        if is_database_outage(exc) or (isinstance(exc, OSError) and conn_closed(conn)):
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
            await notify_settled(store, scope, key, conn)
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
