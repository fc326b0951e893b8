"""Reconciliation: settling ``unknown`` records, and the sweeper that keeps it from losing cases.

* [`Reconciler`][consumer_idem.operations.reconcile.Reconciler] consumes reconciliation notices (run
it on a Kafka or RabbitMQ runner,
  whose dead-letter destination is the operator's queue). For each notice it loads the row (the
  row is the truth: a notice for a row that is no longer ``unknown`` is acked and counted) and
  asks your resolver, which answers [`Executed`][consumer_idem.Executed] (store this result ->
  ``completed``),
  [`NotExecuted`][consumer_idem.NotExecuted] (-> ``failed_retryable``, and the original message is
  re-dispatched so
  it runs once) or [`StillUnknown`][consumer_idem.operations.reconcile.StillUnknown] (ask again
  later, with exponential backoff). An
  ``Executed`` answer for a two-phase scope with ``local_writes`` runs those writes with the
  resolver's result in the resolution's transaction (pass ``local_writes={scope: fn}``, e.g.
  ``{charge.scope: charge.local_writes}``): the local rows a completion would have committed
  are not lost with it. After
  ``max_attempts`` answers, or once the record is older than ``max_age``, the case goes to the
  operator dead-letter destination and stays ``unknown`` until a person resolves it.
* "Not executed" is ordered like an outbox. Every delivery acked with an ``unknown`` outcome
  first kept its original message in the store (``settle.keep_original``: an unarmed outbox
  row). The record becomes ``failed_retryable`` in the same transaction that arms that kept
  original (or, for an older notice, stores the one the notice carries); only then is the
  message re-sent (confirmed by the broker, through the transports' one settle path), its
  outbox row deleted, and the notice acked. A re-dispatch that fails, is refused, is cut short
  by a stopping runner, or never happens because the process died, stays in the outbox and the
  sweeper sends it (with backoff). Re-sending first and resolving after would race: the copy
  could meet the record still ``unknown`` and be acked as a duplicate, and the work would be
  lost. A duplicate re-dispatch is harmless: the consumer replays it. With no original kept
  and none in the notice, no delivery was acked: the record only becomes ``failed_retryable``
  and the broker's redelivery runs it.
* The copy runs under the original's key: it carries the original's headers, AMQP properties
  (``message_id``...), Kafka record key and original coordinates. A key re-dispatched
  ``max_redispatches`` times (each run ended ``unknown`` again, and the resolver keeps saying
  "not executed") goes to the operator (``redispatch_exhausted``) instead of looping.
* [`Sweeper`][consumer_idem.operations.reconcile.Sweeper] parks expired leases as ``unknown``,
publishes every due notice that was
  never published (a crash between parking and publishing) or is due again after a backoff
  (the row works as an outbox), and sends every due re-dispatch of the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from consumer_idem.backoff import Backoff
from consumer_idem.commit import commit, rollback
from consumer_idem.consumer import Action, Verdict
from consumer_idem.errors import (
    CommitRolledBack,
    ConsumerIdemError,
    NotUnknown,
    PublishRefused,
    StoreUnavailable,
)
from consumer_idem.execution import LocalWrites
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice, decode_notice, encode_notice
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.transports.settle import Publisher
from consumer_idem.types import Executed, NotExecuted, Record, Status

log = logging.getLogger("consumer_idem.reconcile")

RECONCILER_SCOPE = "consumer_idem.reconcile"

#: what the reconciler did with a notice (the reason of its verdict), in the store's terms
OUTCOMES = {
    "executed": "resolved executed -> completed",
    "not_executed": "resolved not executed -> failed_retryable (it runs again)",
    "rescheduled": "still unknown, asked again later",
    "reconcile_exhausted": "handed to the operator (attempts or age exhausted)",
    "redispatch_exhausted": "handed to the operator (re-dispatched too often)",
    "stale_notice": "already settled (stale notice)",
    "other_scope": "left to another reconciler (other scope)",
    "invalid_notice": "not a notice (sent to the operator)",
    "store_unavailable": "store unavailable (notice retried)",
}
#: outcomes that need a person: a run with any of them did not settle everything it could
NEEDS_OPERATOR = frozenset({"reconcile_exhausted", "redispatch_exhausted", "invalid_notice"})


@dataclass(frozen=True, slots=True)
class StillUnknown:
    """Resolver answer: it cannot tell yet (the gateway has no record yet, it is down...)."""

    reason: str = "still unknown"


Answer = Executed | NotExecuted | StillUnknown
Resolver = Callable[[Record], Awaitable[Answer]]


#: what the reconciler and the sweeper need from the runner they use (KafkaRunner, RabbitRunner,
#: the FastStream middleware)
Transport = Publisher
#: how a re-dispatch that failed is retried from the outbox (no jitter: few rows, and a failed
#: one must not come due again at once)
REDISPATCH_BACKOFF = Backoff(10.0, 900.0, jitter=False)


class Reconciler:
    """Settles ``unknown`` records from their notices. Drive it with a transport runner."""

    batch = False
    scope = RECONCILER_SCOPE

    def __init__(
        self,
        store: PostgresStore,
        resolver: Resolver,
        *,
        max_attempts: int = 8,
        max_age: timedelta = timedelta(days=2),
        backoff: tuple[float, float] = (30.0, 3600.0),
        redispatch: bool = True,
        scopes: Collection[str] | None = None,
        redispatch_grace: timedelta | float = timedelta(seconds=60),
        max_redispatches: int | None = 5,
        local_writes: Mapping[str, LocalWrites] | None = None,
    ) -> None:
        self.store = store
        #: per scope, the two-phase ``local_writes`` an ``Executed`` answer commits with it
        self.local_writes = dict(local_writes or {})
        #: re-dispatches of one key before "not executed" goes to the operator instead (None:
        #: no bound)
        self.max_redispatches = max_redispatches
        #: how long the sweeper leaves a fresh outbox row to this reconciler's own re-dispatch
        self.redispatch_grace = redispatch_grace
        #: the scopes this reconciler settles (None: all). Notices of other scopes on a shared
        #: topic are acked and left to the reconciler (its own consumer group) that knows them.
        self.scopes = None if scopes is None else frozenset(scopes)
        self.resolver = resolver
        self.max_attempts = max_attempts
        self.max_age = max_age
        self.backoff_base, self.backoff_max = backoff
        # a reschedule is stored, not slept: jitter is not needed to spread reconcilers out
        self._backoff = Backoff(self.backoff_base, self.backoff_max, jitter=False)
        #: send a "not executed" original at once (False: leave it, armed, to the sweeper; it is
        #: re-dispatched either way, since a delivery of it was acked)
        self.redispatch = redispatch
        #: the runner this reconciler runs on, for re-dispatching (set by ``attach``)
        self.transport: Transport | None = None
        #: notices handled so far, by the reason of their verdict (see :data:`OUTCOMES`)
        self.tally: Counter[str] = Counter()

    def attach(self, transport: Transport) -> None:
        self.transport = transport

    def delay(self, attempt: int) -> float:
        return self._backoff.delay(attempt)

    async def process_batch(self, messages: Sequence[ConsumerMessage]) -> list[Verdict]:
        verdicts = []
        for message in messages:
            verdicts.append(await self.process(message))
            if verdicts[-1].action is Action.RETRY:
                break
        return verdicts

    async def process(self, message: ConsumerMessage) -> Verdict:
        verdict = await self._process(message)
        self.tally[verdict.reason or ""] += 1
        return verdict

    async def _process(self, message: ConsumerMessage) -> Verdict:
        try:
            notice = decode_notice(message)
        except ValueError as exc:
            log.warning("not a reconciliation notice (sent to the operator): %s", exc)
            return Verdict(Action.DEAD_LETTER, self.scope, reason="invalid_notice")
        try:
            return await self._settle(notice)
        except (StoreUnavailable, CommitRolledBack):  # nothing was resolved: ask again later
            return Verdict(
                Action.RETRY,
                notice.scope,
                notice.key,
                reason="store_unavailable",
                retry_after=self.backoff_base,
            )

    async def _settle(self, notice: Notice) -> Verdict:
        scope, key = notice.scope, notice.key
        if self.scopes is not None and scope not in self.scopes:
            return Verdict(Action.ACK, scope, key, reason="other_scope", duplicate=True)
        record = await self.store.get(scope, key)
        if record is None or record.status is not Status.UNKNOWN:
            # the row is the truth: settled already (or pruned); the notice is stale
            self.store.metrics.inc("reconcile_stale", scope)
            return Verdict(Action.ACK, scope, key, reason="stale_notice", duplicate=True)
        try:
            answer = await self.resolver(record)
        except Exception as exc:  # a resolver that fails has not answered
            log.warning(
                "scope=%s key=%s: resolver failed (counts as still unknown): %r",
                scope,
                key,
                exc,
                extra={"scope": scope, "key": key},
            )
            answer = StillUnknown(f"resolver error: {type(exc).__name__}: {exc}")
        try:
            if isinstance(answer, Executed):
                failed = await self._executed(scope, key, answer)
                if failed is None:
                    return Verdict(Action.ACK, scope, key, reason="executed")
                answer = failed  # the local writes failed: nothing was resolved, ask again
            if isinstance(answer, NotExecuted):
                return await self._not_executed(notice, answer)
            attempts = record.reconcile_attempts + 1
            age = datetime.now(UTC) - record.created_at
            if attempts >= self.max_attempts or age >= self.max_age:
                await self.store.reconciliation.hand_to_operator(
                    scope, key, f"{answer.reason} after {attempts} attempts"
                )
                # the runner's dead-letter destination is the operator's queue
                return Verdict(Action.DEAD_LETTER, scope, key, reason="reconcile_exhausted")
            delay = self.delay(attempts)
            await self.store.reconciliation.reschedule(scope, key, delay, answer.reason)
            log.info(
                "scope=%s key=%s: still unknown (%s); asking again in %.0fs (attempt %d of %d)",
                scope,
                key,
                answer.reason,
                delay,
                attempts,
                self.max_attempts,
                extra={"scope": scope, "key": key},
            )
            return Verdict(Action.ACK, scope, key, reason="rescheduled")
        except NotUnknown:  # settled by someone else meanwhile (a webhook, an operator)
            return Verdict(Action.ACK, scope, key, reason="stale_notice", duplicate=True)

    async def _executed(self, scope: str, key: str, answer: Executed) -> StillUnknown | None:
        """Store the result, and commit the scope's local writes with it when it has some.
        Returns why it could not (the local writes raised: rolled back, asked again later)."""
        writes = self.local_writes.get(scope)
        if writes is None:
            await self.store.resolve(scope, key, answer)
            return None

        async def resolve_with_writes(conn: Any) -> StillUnknown | None:
            await conn.execute("BEGIN")
            try:
                await self.store.resolve(scope, key, answer, conn=conn)
                try:
                    await writes(conn, answer.result)
                except ConsumerIdemError:
                    raise
                except Exception as exc:
                    log.warning(
                        "scope=%s key=%s: executed, but its local writes failed (rolled back, "
                        "asked again later): %r",
                        scope,
                        key,
                        exc,
                        extra={"scope": scope, "key": key},
                    )
                    await rollback(conn)
                    return StillUnknown(f"local_writes failed: {type(exc).__name__}: {exc}"[:500])
            except BaseException:
                await rollback(conn)
                raise
            await commit(conn)  # its failure is classified by store.run, like any store error
            return None

        return await self.store.run("resolve", scope, None, resolve_with_writes)

    async def _not_executed(self, notice: Notice, answer: NotExecuted) -> Verdict:
        scope, key = notice.scope, notice.key
        extra = {"scope": scope, "key": key}
        if self.max_redispatches is not None:
            sent = await self.store.redispatch.redispatch_count(scope, key)
            if sent >= self.max_redispatches:
                # every re-run ended unknown again: a person must look (the kept original
                # stays; resolving the record "not executed" arms it)
                await self.store.reconciliation.hand_to_operator(
                    scope,
                    key,
                    f"redispatch_exhausted: re-dispatched {sent} times, each run ended "
                    f"unknown; the resolver still says: {answer.reason}",
                )
                return Verdict(Action.DEAD_LETTER, scope, key, reason="redispatch_exhausted")
        # resolution and the armed original commit together: from here the work cannot be lost
        entry = await self.store.reconciliation.resolve_not_executed(
            scope,
            key,
            answer,
            notice if notice.original else None,
            due_in=self.redispatch_grace if self.redispatch else 0.0,
        )
        if entry is None:
            log.info(
                "scope=%s key=%s: no original message kept or carried: no delivery of it was "
                "acked, so the broker delivers it again and that runs it",
                scope,
                key,
                extra=extra,
            )
        elif self.redispatch:
            await self._redispatch(entry.id, entry.notice)
        return Verdict(Action.ACK, scope, key, reason="not_executed")

    async def _redispatch(self, outbox_id: int, notice: Notice) -> None:
        """Send the original message now, if it can be; whatever fails, its outbox row stays
        and the sweeper sends it (the notice can be acked either way)."""
        scope, key = notice.scope, notice.key
        extra = {"scope": scope, "key": key}
        if self.transport is None:
            log.info(
                "scope=%s key=%s: no transport attached: the sweeper re-dispatches it",
                scope,
                key,
                extra=extra,
            )
            return
        try:
            sent = await self.transport.redispatch(notice)
        except Exception as exc:  # refused, or anything else: the outbox keeps it
            log.warning(
                "scope=%s key=%s: re-dispatch to %s failed (%r); the sweeper retries it",
                scope,
                key,
                notice.source,
                exc,
                extra=extra,
            )
            with contextlib.suppress(StoreUnavailable):
                await self.store.redispatch.redispatch_failed(
                    outbox_id, repr(exc), REDISPATCH_BACKOFF.delay(1)
                )
            return
        if not sent:  # stopping: the outbox row stays, due after the grace period
            log.info(
                "scope=%s key=%s: re-dispatch not sent (stopping); the sweeper sends it",
                scope,
                key,
                extra=extra,
            )
            return
        with contextlib.suppress(StoreUnavailable):  # lost: the sweeper sends a duplicate,
            await self.store.redispatch.redispatch_done(outbox_id)  # which the consumer replays


@dataclass(frozen=True, slots=True)
class SweeperReport:
    """What one pass of the [`Sweeper`][consumer_idem.operations.reconcile.Sweeper] did (or, summed,
    all of them)."""

    zombies: int = 0  #: expired leases parked as unknown
    published: int = 0  #: due notices published
    refused: int = 0  #: due notices the broker refused (still due: tried on the next pass)
    redispatched: int = 0  #: due re-dispatches of the outbox sent
    redispatch_failed: int = 0  #: re-dispatches that failed (kept, due again after a backoff)

    def __add__(self, other: SweeperReport) -> SweeperReport:
        return SweeperReport(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )

    @property
    def failures(self) -> int:
        return self.refused + self.redispatch_failed


class Sweeper:
    """Expired leases -> ``unknown``; due, unpublished notices -> published; due re-dispatches
    of the outbox -> sent."""

    def __init__(
        self,
        store: PostgresStore,
        transport: Transport,
        *,
        batch: int = 100,
        scopes: Collection[str] | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        self.batch = batch
        self.scopes = None if scopes is None else sorted(scopes)
        #: every pass so far, summed
        self.total = SweeperReport()

    async def run_once(self) -> SweeperReport:
        swept = await self.store.maintenance.sweep()
        published, refused = await self._notices()
        redispatched, failed = await self._redispatches()
        report = SweeperReport(swept.parked, published, refused, redispatched, failed)
        self.total += report
        return report

    async def _notices(self) -> tuple[int, int]:
        """(published, refused)."""
        published = refused = 0
        while True:
            due = await self.store.reconciliation.due_notices(self.batch, self.scopes)
            sent = 0
            for record in due:
                body = encode_notice(record.scope, record.key, record.last_error)
                try:
                    ok = await self.transport.publish_notice(record.scope, record.key, body)
                except PublishRefused as exc:  # stays due: tried again on the next sweep
                    refused += 1
                    log.error(
                        "scope=%s key=%s: reconciliation notice refused, tried again on the "
                        "next sweep: %s",
                        record.scope,
                        record.key,
                        exc,
                        extra={"scope": record.scope, "key": record.key},
                    )
                    continue
                if not ok:  # stopping
                    return published + sent, refused
                sent += 1
            published += sent
            if len(due) < self.batch or sent < len(due):  # not all went: do not spin on them
                return published, refused

    async def _redispatches(self) -> tuple[int, int]:
        """(sent, failed)."""
        redispatched = failed = 0
        while True:
            due = await self.store.redispatch.pending_redispatches(self.batch, self.scopes)
            for entry in due:
                scope, key = entry.notice.scope, entry.notice.key
                extra = {"scope": scope, "key": key}
                try:
                    sent = await self.transport.redispatch(entry.notice)
                except Exception as exc:  # kept, due again after a backoff
                    failed += 1
                    log.warning(
                        "scope=%s key=%s: re-dispatch to %s failed (%r); retrying later",
                        scope,
                        key,
                        entry.notice.source,
                        exc,
                        extra=extra,
                    )
                    await self.store.redispatch.redispatch_failed(
                        entry.id, repr(exc), REDISPATCH_BACKOFF.delay(entry.attempts + 1)
                    )
                    continue
                if not sent:  # stopping
                    return redispatched, failed
                await self.store.redispatch.redispatch_done(entry.id)
                redispatched += 1
                log.info(
                    "scope=%s key=%s: original re-dispatched to %s from the outbox",
                    scope,
                    key,
                    entry.notice.source,
                    extra=extra,
                )
            if len(due) < self.batch:
                return redispatched, failed

    async def run(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        while not stop.is_set():
            try:
                report = await self.run_once()
                if report != SweeperReport():
                    log.info(
                        "sweep: %d zombies parked, %d notices published (%d refused), "
                        "%d re-dispatched (%d failed)",
                        report.zombies,
                        report.published,
                        report.refused,
                        report.redispatched,
                        report.redispatch_failed,
                    )
            except StoreUnavailable as exc:
                log.warning("sweep failed, will retry: %s", exc)
            except ConsumerIdemError as exc:
                # Refused or misconfigured: loud, but the loop stays. Ended by one failed
                # pass, it would leave expired leases unparked and notices unpublished until a
                # restart, with the error seen only at shutdown.
                log.error("sweep failed, tried again in %.0f s: %s", interval, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
