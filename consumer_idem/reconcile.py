"""Reconciliation: settling ``unknown`` records, and the sweeper that keeps it from losing cases.

* :class:`Reconciler` consumes reconciliation notices (run it on a Kafka or RabbitMQ runner,
  whose dead-letter destination is the operator's queue). For each notice it loads the row (the
  row is the truth: a notice for a row that is no longer ``unknown`` is acked and counted) and
  asks your resolver, which answers :class:`Executed` (store this result -> ``completed``),
  :class:`NotExecuted` (-> ``failed_retryable``, and the original message is re-dispatched so
  it runs once) or :class:`StillUnknown` (ask again later, with exponential backoff). After
  ``max_attempts`` answers, or once the record is older than ``max_age``, the case goes to the
  operator dead-letter destination and stays ``unknown`` until a person resolves it.
* :class:`Sweeper` parks expired leases as ``unknown`` and publishes every due notice that was
  never published (a crash between parking and publishing) or is due again after a backoff:
  the row works as an outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from consumer_idem.consumer import Action, Verdict
from consumer_idem.errors import NotUnknown, StoreUnavailable
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice, decode_notice, encode_notice
from consumer_idem.store import Executed, NotExecuted, PostgresStore
from consumer_idem.types import Record, Status

log = logging.getLogger("consumer_idem.reconcile")

RECONCILER_SCOPE = "consumer_idem.reconcile"


@dataclass(frozen=True, slots=True)
class StillUnknown:
    """Resolver answer: it cannot tell yet (the gateway has no record yet, it is down...)."""

    reason: str = "still unknown"


Answer = Executed | NotExecuted | StillUnknown
Resolver = Callable[[Record], Awaitable[Answer]]


class Transport(Protocol):
    """What the reconciler needs from the runner it runs on (KafkaRunner, RabbitRunner)."""

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool: ...

    async def redispatch(self, notice: Notice) -> bool: ...


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
    ) -> None:
        self.store = store
        #: the scopes this reconciler settles (None: all). Notices of other scopes on a shared
        #: topic are acked and left to the reconciler (its own consumer group) that knows them.
        self.scopes = None if scopes is None else frozenset(scopes)
        self.resolver = resolver
        self.max_attempts = max_attempts
        self.max_age = max_age
        self.backoff_base, self.backoff_max = backoff
        self.redispatch = redispatch
        #: the runner this reconciler runs on, for re-dispatching (set by ``attach``)
        self.transport: Transport | None = None

    def attach(self, transport: Transport) -> None:
        self.transport = transport

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff_max, self.backoff_base * 2 ** max(0, attempt - 1)))

    async def process_batch(self, messages: Sequence[ConsumerMessage]) -> list[Verdict]:
        verdicts = []
        for message in messages:
            verdicts.append(await self.process(message))
            if verdicts[-1].action is Action.RETRY:
                break
        return verdicts

    async def process(self, message: ConsumerMessage) -> Verdict:
        try:
            notice = decode_notice(message)
        except ValueError as exc:
            log.warning("not a reconciliation notice: %s", exc)
            return Verdict(Action.DEAD_LETTER, self.scope, reason="invalid_notice")
        try:
            return await self._settle(notice)
        except StoreUnavailable:
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
            log.warning("resolver failed: %r", exc, extra={"scope": scope, "key": key})
            answer = StillUnknown(f"resolver error: {type(exc).__name__}: {exc}")
        try:
            if isinstance(answer, Executed):
                await self.store.resolve(scope, key, answer)
                return Verdict(Action.ACK, scope, key, reason="executed")
            if isinstance(answer, NotExecuted):
                await self.store.resolve(scope, key, answer)
                sent = (
                    self.redispatch
                    and self.transport is not None
                    and await self.transport.redispatch(notice)
                )
                if self.redispatch and not sent:
                    log.info(
                        "no original message to re-dispatch; the next delivery runs it",
                        extra={"scope": scope, "key": key},
                    )
                return Verdict(Action.ACK, scope, key, reason="not_executed")
            attempts = record.reconcile_attempts + 1
            age = datetime.now(UTC) - record.created_at
            if attempts >= self.max_attempts or age >= self.max_age:
                await self.store.hand_to_operator(
                    scope, key, f"{answer.reason} after {attempts} attempts"
                )
                # the runner's dead-letter destination is the operator's queue
                return Verdict(Action.DEAD_LETTER, scope, key, reason="reconcile_exhausted")
            await self.store.reschedule(scope, key, self.delay(attempts), answer.reason)
            return Verdict(Action.ACK, scope, key, reason="rescheduled")
        except NotUnknown:  # settled by someone else meanwhile (a webhook, an operator)
            return Verdict(Action.ACK, scope, key, reason="stale_notice", duplicate=True)


@dataclass
class SweepReport:
    zombies: int = 0  #: expired leases parked as unknown
    published: int = 0  #: due notices published


class Sweeper:
    """Expired leases -> ``unknown``; due, unpublished notices -> published."""

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

    async def run_once(self) -> SweepReport:
        report = SweepReport(zombies=await self.store.sweep())
        while True:
            due = await self.store.due_notices(self.batch, self.scopes)
            for record in due:
                body = encode_notice(record.scope, record.key, record.last_error)
                if await self.transport.publish_notice(record.scope, record.key, body):
                    report.published += 1
            if len(due) < self.batch:
                return report

    async def run(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        while not stop.is_set():
            try:
                report = await self.run_once()
                if report.zombies or report.published:
                    log.info(
                        "sweep: %d zombies parked, %d notices published",
                        report.zombies,
                        report.published,
                    )
            except StoreUnavailable as exc:
                log.warning("sweep failed, will retry: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
