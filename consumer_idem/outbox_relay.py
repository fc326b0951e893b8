"""The relay of what the dispatch left behind (a crash, an outage, a full queue) and
[`OutboxService`][consumer_idem.outbox_relay.OutboxService], which runs the dispatch and the relay
for a process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from consumer_idem.commit import commit, rollback
from consumer_idem.errors import (
    IdempotencyConfigError,
    StoreUnavailable,
)
from consumer_idem.outbox_dispatch import (
    OutboxDispatcher,
    attach_dispatcher,
    detach_dispatcher,
)
from consumer_idem.outbox_identity import route_of
from consumer_idem.outbox_send import (
    RETRY_BACKOFF,
    OutboxSender,
    _count,
    _log_parked,
    _send,
    failure_text,
)
from consumer_idem.outbox_stranded import report_stranded
from consumer_idem.stores.postgres.store import PostgresStore


async def _begin(conn: Any) -> None:
    await conn.execute("BEGIN")


log = logging.getLogger("consumer_idem.outbox")


@dataclass(frozen=True, slots=True)
class RelayReport:
    """What one pass of an [`OutboxRelay`][consumer_idem.outbox_relay.OutboxRelay] did (or, summed,
    several)."""

    sent: int = 0  #: confirmed by the broker, marked sent
    failed: int = 0  #: not sent (an outage): due again after a backoff
    parked: int = 0  #: refused for good: parked with the reason
    pruned: int = 0  #: sent messages deleted after the retention

    def __add__(self, other: RelayReport) -> RelayReport:
        return RelayReport(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class OutboxRelay:
    """Sends the outgoing messages that are still pending once they are due: a crash between
    a unit's COMMIT and its dispatch, a failed or skipped dispatch. Each batch is locked
    (``FOR UPDATE SKIP LOCKED``), sent and settled in one transaction, so relays in several
    processes share the work and never send the same message at the same time.

    It sends only the messages published for its sender's route (the transport and broker the
    sender states: ``sender.route``), destination by destination: a destination whose send
    failed waits out its backoff as a whole and never holds back another one. ``scopes``: only
    these units' messages (None: all of its route; a relay naming its scopes also sends their
    messages that record no route, written before routes were recorded or where no sender was
    attached). ``retention``: how long sent messages are kept before each pass prunes them (in
    batches of ``prune_batch``). Each pass also sets the outbox gauges of its scopes
    (``outbox_pending``, ``outbox_parked``, ``outbox_oldest_pending_seconds``,
    ``outbox_stranded``). A pass takes what was committed before it began."""

    def __init__(
        self,
        store: PostgresStore,
        sender: OutboxSender,
        *,
        scopes: Collection[str] | None = None,
        batch: int = 200,
        retention: timedelta | float = timedelta(hours=1),
        prune_batch: int = 1000,
        send_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.sender = sender
        self.scopes = None if scopes is None else sorted(scopes)
        self.route = route_of(sender)
        if self.route is None and self.scopes is None:
            raise IdempotencyConfigError(
                f"{type(sender).__name__} states no route (the transport and broker it sends "
                "to: a 'route' attribute), so a relay for every scope cannot tell its own "
                "messages from another transport's: give it a route, or name its scopes"
            )
        self.batch = batch
        self.retention = retention
        self.prune_batch = prune_batch
        self.send_timeout = send_timeout
        #: every pass so far, summed
        self.total = RelayReport()
        self._gauged: set[str] = set()
        self.stranded_after = 300.0  #: seconds pending for another route: outbox_stranded
        self.stranded_warned: set[tuple[str, str]] = set()

    async def run_once(self) -> RelayReport:
        """Send what was due and committed before the pass began, prune, update the gauges."""
        report, upto = RelayReport(), await self.store.outbox.newest_id()
        while True:
            done, claimed = await self._one_batch(upto)
            report += done
            # none due, or none settled (a failed destination is held now: the next batch
            # goes to the others; all failed: the next pass tries again)
            if claimed == 0 or done.sent + done.parked == 0:
                break
        pruned = 0
        while True:
            n = await self.store.outbox.prune(self.retention, self.prune_batch)
            pruned += n
            if n < self.prune_batch:
                break
        if pruned:  # (sent messages of any scope: counted without one)
            self.store.metrics.inc("outbox_pruned", "", pruned)
        report += RelayReport(pruned=pruned)
        await self.update_gauges()
        self.total += report
        return report

    async def _one_batch(self, upto: int | None) -> tuple[RelayReport, int]:
        store = self.store
        async with store.connection() as conn:
            try:
                # through the store, as the claim and settle are: a dropped connection is an
                # outage (StoreUnavailable), not the driver's error
                await store.run("outbox_relay", "", conn, _begin)
                claim = store.outbox.claim_due(conn, self.batch, self.scopes, self.route, upto)
                if not (messages := await claim):
                    await rollback(conn)
                    return RelayReport(), 0
                done = await _send(self.sender, messages, self.send_timeout)
                failed = [
                    (m, failure_text(exc), RETRY_BACKOFF.delay(m.attempts + 1))
                    for m, exc in done.failed
                ]
                parked = [(m, failure_text(exc)) for m, exc in done.parked]
                await store.outbox.settle_claimed(conn, done.sent, failed, parked)
                await store.run("outbox_relay", "", conn, commit)
            except BaseException:
                # nothing marked: sent ones go again (duplicates the next consumer drops)
                await rollback(conn)
                raise
        _log_parked(done.parked)
        if done.failed:
            message, exc = done.failed[0]
            log.warning(
                "outbox relay: %d messages not sent (%s); retried after a backoff",
                len(done.failed),
                failure_text(exc),
                extra={"scope": message.scope},
            )
        _count(store, "outbox_relayed", done.sent)
        _count(store, "outbox_failed", [m for m, _, _ in failed])
        _count(store, "outbox_parked", [m for m, _ in parked])
        return RelayReport(len(done.sent), len(failed), len(parked)), len(messages)

    async def update_gauges(self) -> None:
        """Set the outbox gauges (per scope label) from the table."""
        stats = await self.store.outbox.stats(count_sent=False)
        metrics = self.store.metrics
        figures: dict[str, list[float]] = {}
        for s in stats.scopes:
            if self.scopes is not None and s.scope not in self.scopes:
                continue
            label = metrics.label(s.scope)
            pending, parked, oldest = figures.setdefault(label, [0.0, 0.0, 0.0])
            figures[label] = [
                pending + s.pending,
                parked + s.parked,
                max(oldest, s.oldest_pending_s or 0.0),
            ]
        for label in self._gauged - set(figures):  # emptied since the last pass
            figures[label] = [0.0, 0.0, 0.0]
        for label, (pending, parked, oldest) in figures.items():
            metrics.gauge("outbox_pending", label, pending)
            metrics.gauge("outbox_parked", label, parked)
            metrics.gauge("outbox_oldest_pending_seconds", label, oldest)
        self._gauged = {label for label, f in figures.items() if any(f)}
        await report_stranded(self)

    async def run(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        """A pass every ``interval`` seconds until ``stop`` is set."""
        while not stop.is_set():
            try:
                report = await self.run_once()
                if report.sent or report.failed or report.parked:
                    log.info(
                        "outbox relay: %d sent, %d failed, %d parked, %d pruned",
                        report.sent,
                        report.failed,
                        report.parked,
                        report.pruned,
                    )
            except StoreUnavailable as exc:
                log.warning("outbox relay pass failed, will retry: %s", exc)
            except Exception:
                log.exception("outbox relay pass failed, will retry")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)


class OutboxService:
    """A process's outbox duties for the units of ``scopes`` (None: any) on ``store``: the
    dispatch right after each COMMIT, and (with ``relay_interval`` seconds, None for none) a
    relay pass every so often. The runners start one; use it yourself for HTTP apps::

        async with OutboxService(store, KafkaOutboxSender(producer)):
            ...  # serve requests

    ``send_timeout``: how long a send may take before it counts as failed (both).
    ``dispatch``: other options of `OutboxDispatcher` (``linger``, ``backlog``...);
    ``relay``: other options of [`OutboxRelay`][consumer_idem.outbox_relay.OutboxRelay]
    (``retention``, ``batch``...)."""

    def __init__(
        self,
        store: PostgresStore,
        sender: OutboxSender,
        *,
        scopes: Collection[str] | None = None,
        relay_interval: float | None = 5.0,
        drain_timeout: float = 10.0,
        send_timeout: float = 30.0,
        dispatch: Mapping[str, Any] | None = None,
        **relay: Any,
    ) -> None:
        self.store = store
        self.sender = sender
        self.scopes = None if scopes is None else list(scopes)
        self.relay_interval = relay_interval
        self.drain_timeout = drain_timeout
        self.send_timeout = send_timeout
        self.dispatch = dict(dispatch or {})
        self.relay = OutboxRelay(
            store, sender, scopes=self.scopes, send_timeout=send_timeout, **relay
        )
        self.dispatcher: OutboxDispatcher | None = None
        self._stop = asyncio.Event()
        self._relaying: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.dispatcher is not None:
            return
        self.dispatcher = attach_dispatcher(
            self.store, self.sender, self.scopes, send_timeout=self.send_timeout, **self.dispatch
        )
        self._stop.clear()
        if self.relay_interval is not None:
            self._relaying = asyncio.create_task(
                self.relay.run(self._stop, self.relay_interval), name="consumer-idem outbox relay"
            )

    async def stop(self) -> None:
        """Send what the dispatch holds (up to ``drain_timeout``), stop the relay; what is left
        stays pending for the next relay."""
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            detach_dispatcher(self.store, dispatcher)
            await dispatcher.close(self.drain_timeout)
        self._stop.set()
        if self._relaying is not None:
            relaying, self._relaying = self._relaying, None
            # (on a timeout wait_for cancels it: its transaction rolls back)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(relaying, self.drain_timeout)

    async def __aenter__(self) -> OutboxService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
