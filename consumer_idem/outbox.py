"""The transactional outbox: outgoing messages are part of the idempotent effect.

A handler that publishes straight to a broker publishes even when its transaction then rolls
back, and again when a redelivery runs after a crash before the ack. Through the outbox, a
handler's messages are rows inserted in the unit's own transaction, with its effect and its
idempotency record: nothing leaves before the COMMIT, a rollback leaves nothing, and a replayed
duplicate does not run the handler, so it publishes nothing::

    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO ledger ...")
        outbox_for(conn).publish("payments.booked", {"payment_id": ...}, key=b"cust-7")

How a handler reaches its unit's outbox, per entry point (the unit is found by its connection):

* ``@idempotent_consumer`` / :func:`~consumer_idem.execution.run_transactional`:
  ``outbox_for(conn)``; in batch mode ``outbox_for(conn, message)`` (each message is a unit);
* HTTP (transactional routes): ``consumer_idem.http.outbox_of(request)`` (also a FastAPI
  dependency: ``outbox: UnitOutbox = Depends(outbox_of)``);
* FastStream: the ``IdempotentOutbox`` annotation (``consumer_idem.faststream``);
* a SQLAlchemy session bound to the unit: ``outbox_for(connection_of(session))``.

After the COMMIT, the process that ran the unit sends its messages at once (an
:class:`OutboxDispatcher` attached to the store, e.g. by a runner) and marks them sent. A relay
(:class:`OutboxRelay`, ``FOR UPDATE SKIP LOCKED``: run it in as many processes as you like) sends
what a crash, an outage or a full dispatch queue left behind, once the committing process has
had ``store.outbox.relay_after`` to do it. :class:`OutboxService` runs both for a process.

What it promises: every message of a committed unit is sent at least once (a crash between the
broker's confirmation and the mark sends it again), and never one of a unit that did not commit.
Each carries an ``idempotency-key`` header derived from the unit's scope, key, run and the
message's position in the unit (:func:`outgoing_key`), the same on every copy: a consumer using this
library (``header("idempotency-key")``, the default key strategy) drops the copies for free.
Messages of one unit to one destination with one key are sent in the order they were
published. A message the broker refuses for good is parked with its reason
(``consumer-idem stats``, :meth:`~consumer_idem.stores.postgres.outbox.Outbox.parked`), never
dropped; it does not hold back the later ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from consumer_idem.backoff import Backoff
from consumer_idem.commit import commit, rollback
from consumer_idem.errors import (
    ConsumerIdemError,
    IdempotencyConfigError,
    NoOutbox,
    StoreUnavailable,
)
from consumer_idem.outbox_identity import outgoing_key, route_of
from consumer_idem.outbox_stranded import report_stranded
from consumer_idem.outbox_unit import UnitOutbox
from consumer_idem.stores.postgres.outbox import (
    IDEMPOTENCY_HEADER,
    OutboxScopeStats,
    OutboxStats,
    OutgoingMessage,
    ParkedMessage,
)
from consumer_idem.stores.postgres.store import PostgresStore

__all__ = [
    "IDEMPOTENCY_HEADER",
    "HeldBack",
    "OutboxDispatcher",
    "OutboxRelay",
    "OutboxScopeStats",
    "OutboxSender",
    "OutboxService",
    "OutboxStats",
    "OutgoingMessage",
    "ParkedMessage",
    "RelayReport",
    "UnitOutbox",
    "attach_dispatcher",
    "outbox_for",
    "outgoing_key",
]

log = logging.getLogger("consumer_idem.outbox")

#: how a message whose send failed (for a reason that may pass) is retried by the relay
RETRY_BACKOFF = Backoff(1.0, 300.0)


# --- which unit runs on a connection -------------------------------------------------------------


@dataclass(eq=False)
class _Units:
    """The unit (or, in batch mode, the units by message) running on one connection. A batch's
    units are made when a handler first asks for one: most members publish nothing, and a
    batch of hundreds should not pay for hundreds of empty outboxes."""

    scope: str
    #: the route of the sender serving ``scope`` here when the units began
    route: str | None = None
    single: UnitOutbox | None = None
    #: batch mode: the members, and each one's key
    messages: tuple[Any, ...] = ()
    keys: Sequence[str] = ()
    #: batch mode: id(message) -> its position, built when a handler first asks for an outbox
    position: dict[int, int] | None = None
    #: batch mode: position -> the member's outbox, once asked for
    made: dict[int, UnitOutbox] = field(default_factory=dict)

    def all(self) -> list[UnitOutbox]:
        """Every unit with an outbox, in the batch's order."""
        if self.single is not None:
            return [self.single]
        return [self.made[i] for i in sorted(self.made)]

    def of(self, message: Any) -> UnitOutbox:
        if self.position is None:
            self.position = {id(m): i for i, m in enumerate(self.messages)}
        i = self.position.get(id(message))
        if i is None:
            raise NoOutbox("this message is not one of the batch this handler runs")
        unit = self.made.get(i)
        if unit is None:
            unit = self.made[i] = UnitOutbox(self.scope, self.keys[i], route=self.route)
        return unit


#: connection -> its running unit(s); an entry lives exactly as long as the unit's transaction
_running: dict[Any, _Units] = {}


def outbox_for(conn: Any, message: Any = None) -> UnitOutbox:
    """The outbox of the idempotent unit running on ``conn`` (the connection a transactional
    handler was given). In batch mode pass the ``message`` the outgoing one belongs to: each
    message of a batch is its own unit. Raises :class:`NoOutbox` when no unit runs on ``conn``
    (it is not the unit's connection, the unit has ended, or it is two-phase)."""
    units = _running.get(conn)
    if units is None:
        raise NoOutbox(
            "no idempotent unit runs on this connection: use the connection your transactional "
            "handler was given, while it runs"
        )
    if units.single is not None:
        return units.single
    if message is None:
        raise NoOutbox(
            "batch mode: each message is its own unit; say which one the outgoing message "
            "belongs to: outbox_for(conn, message)"
        )
    return units.of(message)


def _route_here(store: PostgresStore | None, scope: str) -> str | None:
    dispatcher = None if store is None else dispatcher_for(store, scope)
    return None if dispatcher is None else route_of(dispatcher.sender)


def open_unit(conn: Any, scope: str, key: str, store: PostgresStore | None = None) -> UnitOutbox:
    """The claim engine: the unit (``scope``, ``key``) owns ``conn``'s transaction now (a new
    run of it; its messages are for the route of ``store``'s sender for ``scope``)."""
    route = _route_here(store, scope)
    unit = UnitOutbox(scope, key, route=route)
    _running[conn] = _Units(scope, route, single=unit)
    return unit


def open_batch(
    conn: Any,
    scope: str,
    messages: Sequence[Any],
    keys: Sequence[str],
    store: PostgresStore | None = None,
) -> _Units:
    """Batch mode: each of ``messages`` (with its key, ``keys[i]``) is a unit in ``conn``'s
    transaction; what they published is ``pending(units)`` of the answer."""
    units = _Units(scope, _route_here(store, scope), messages=tuple(messages), keys=keys)
    _running[conn] = units
    return units


def close_units(conn: Any) -> None:
    """The transaction on ``conn`` ended (committed or not): its units' outboxes take no more
    messages."""
    units = _running.pop(conn, None)
    if units is not None:
        for unit in units.all():
            unit.ended = True


def pending(units: _Units) -> list[OutgoingMessage]:
    """What the batch's members published: member by member, in the batch's order."""
    return [m for unit in units.all() for m in unit.messages]


# --- senders -------------------------------------------------------------------------------------


@runtime_checkable
class OutboxSender(Protocol):
    """What sends outgoing messages: ``KafkaOutboxSender``, ``RabbitOutboxSender``
    (``consumer_idem.transports``), the runners, FastStream's ``Idempotency``.

    A sender also states its ``route`` (a string attribute: the transport and the broker it
    sends to, e.g. ``kafka:<bootstrap servers>``), recorded with the messages it is to send;
    a relay sends only messages of its sender's route (see :mod:`consumer_idem.outbox_identity`).
    One without a ``route`` serves only relays that name their scopes."""

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        """Publish ``messages`` and wait for the broker's confirmations: for each, ``None``
        (confirmed) or the error. Messages of one :attr:`OutgoingMessage.group` go in order,
        and after one of them failed (not for good) the later ones are not sent
        (:class:`HeldBack`)."""
        ...

    def permanent(self, exc: BaseException) -> bool:
        """Whether the broker will refuse the same message again (it is parked)."""
        ...


class HeldBack(ConsumerIdemError):
    """Not sent: an earlier message of its unit to the same destination and key failed, and
    sending this one first would change their order."""


def failure_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


@dataclass
class _Sorted:
    sent: list[OutgoingMessage]
    failed: list[tuple[OutgoingMessage, BaseException]]
    parked: list[tuple[OutgoingMessage, BaseException]]


async def _send(
    sender: OutboxSender, messages: Sequence[OutgoingMessage], within: float
) -> _Sorted:
    try:
        results = await asyncio.wait_for(sender.send_batch(messages), within)
    except Exception as exc:  # the sender itself failed (no connection, a timeout): all of them
        results = [exc] * len(messages)
    if len(results) != len(messages):
        raise RuntimeError(f"the sender answered {len(results)} results for {len(messages)}")
    out = _Sorted([], [], [])
    for message, result in zip(messages, results, strict=True):
        if result is None:
            out.sent.append(message)
        elif sender.permanent(result):
            out.parked.append((message, result))
        else:
            out.failed.append((message, result))
    return out


def _count(store: PostgresStore, name: str, messages: Sequence[OutgoingMessage]) -> None:
    """Count ``name`` once per message, by the scope of the unit that published it."""
    for scope, n in Counter(m.scope for m in messages).items():
        store.metrics.inc(name, scope, n)


def _log_parked(parked: Sequence[tuple[OutgoingMessage, BaseException]]) -> None:
    for message, exc in parked:
        log.error(
            "scope=%s key=%s: outgoing message %d to %s refused for good (%s): parked, with "
            "its reason, for an operator",
            message.scope,
            message.unit_key,
            message.position,
            message.destination,
            failure_text(exc),
            extra={"scope": message.scope, "key": message.unit_key},
        )


# --- right after the commit ----------------------------------------------------------------------


class OutboxDispatcher:
    """Sends the messages of the units this process commits, right after each COMMIT, and
    marks them sent. Messages wait in an in-memory queue. While more than ``backlog`` wait, a
    consumer waits before its next delivery (at most ``max_wait`` seconds, holding no pooled
    connection of its own: :func:`backpressure`), so it slows to the pace of the broker instead
    of filling memory. Beyond ``max_queued`` (the broker hangs) messages are left to the relay,
    as are those a crash or an outage leaves; nothing is lost, it is only later.

    Sends are batched: a send takes whatever was committed within ``linger`` seconds (or
    ``batch`` messages, whichever comes first), and whatever commits while it is in flight
    goes in the next one. One broker request per message would cost the broker (and this
    process) as much as the unit itself; a few milliseconds of latency buys several messages
    per request. Attach it with :func:`attach_dispatcher` (a runner does it for you)."""

    def __init__(
        self,
        store: PostgresStore,
        sender: OutboxSender,
        *,
        max_queued: int = 20_000,
        backlog: int = 2_000,
        max_wait: float = 5.0,
        batch: int = 1000,
        linger: float = 0.025,
        send_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.sender = sender
        self.max_queued = max_queued
        self.backlog = backlog
        self.max_wait = max_wait
        self.batch = batch
        self.linger = linger
        self.send_timeout = send_timeout
        self._queue: deque[list[OutgoingMessage]] = deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._unmarked: list[OutgoingMessage] = []
        self._marking: asyncio.Task[None] | None = None

    def enqueue(self, messages: list[OutgoingMessage]) -> None:
        """Messages of one committed unit (kept together: their order is kept)."""
        if not messages:
            return
        if self._closed or self._queued + len(messages) > self.max_queued:
            _count(self.store, "outbox_left_to_relay", messages)
            log.debug(
                "scope=%s: dispatch queue full or closed: %d messages left to the relay",
                messages[0].scope,
                len(messages),
            )
            return
        self._queue.append(messages)
        self._queued += len(messages)
        self._idle.clear()
        self._wake.set()
        if self._queued >= self.batch:
            self._full.set()
        if self._queued > self.backlog:
            self._room.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="consumer-idem outbox dispatch"
            )

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.linger > 0 and self._queued < self.batch and not self._closed:
                with contextlib.suppress(TimeoutError):  # what commits meanwhile goes along
                    await asyncio.wait_for(self._full.wait(), self.linger)
            self._full.clear()
            batch: list[OutgoingMessage] = []
            while self._queue and (not batch or len(batch) + len(self._queue[0]) <= self.batch):
                batch.extend(self._queue.popleft())
            self._queued -= len(batch)
            if self._queued <= self.backlog:
                self._room.set()
            try:
                await self._dispatch(batch)
            except Exception:  # never let one bad batch stop dispatching: the relay has them
                log.exception("outbox dispatch failed; the relay sends these messages")

    async def _dispatch(self, messages: list[OutgoingMessage]) -> None:
        done = await _send(self.sender, messages, self.send_timeout)
        store = self.store
        if done.sent:  # marked in the background: the next send need not wait for it
            self._unmarked.extend(done.sent)
            if self._marking is None or self._marking.done():
                self._marking = asyncio.get_running_loop().create_task(
                    self._mark(), name="consumer-idem outbox marks"
                )
        try:
            if done.parked:
                _log_parked(done.parked)
                for message, exc in done.parked:
                    await store.outbox.park([message], failure_text(exc))
                _count(store, "outbox_parked", [m for m, _ in done.parked])
            if done.failed:
                message, exc = done.failed[0]
                log.warning(
                    "scope=%s: %d outgoing messages not sent (%s); the relay retries them",
                    message.scope,
                    len(done.failed),
                    failure_text(exc),
                    extra={"scope": message.scope},
                )
                failed = [m for m, _ in done.failed]
                await store.outbox.mark_failed(failed, failure_text(exc), RETRY_BACKOFF.delay(1))
                _count(store, "outbox_failed", failed)
        except ConsumerIdemError as exc:  # a relay takes them when they are due
            log.warning("recording failed sends failed (%s); the relay retries them", exc)

    async def _mark(self) -> None:
        """Mark what was sent, the messages of many sends in one statement: while a mark is
        in flight, the next sends' messages gather for the one after it."""
        while self._unmarked:
            sent, self._unmarked = self._unmarked, []
            try:
                await self.store.outbox.mark_sent(sent)
            except ConsumerIdemError as exc:
                # sent, but not marked: a relay sends them again (copies the next consumer
                # drops by their idempotency-key)
                log.warning("marking sent messages failed (%s); a relay sends them again", exc)
                continue
            _count(self.store, "outbox_sent", sent)

    async def wait_for_room(self) -> None:
        """Return once no more than ``backlog`` messages wait (or after ``max_wait``)."""
        if self._room.is_set() or self._closed:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), self.max_wait)

    async def drain(self, within: float) -> bool:
        """Wait (up to ``within`` seconds) until every queued message was sent (or failed)
        and the sent ones were marked."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        try:
            await asyncio.wait_for(self._idle.wait(), within)
            while self._marking is not None and not self._marking.done():
                left = max(0.0, deadline - loop.time())
                await asyncio.wait_for(asyncio.shield(self._marking), left)
        except TimeoutError:
            return False
        return True

    async def close(self, within: float = 10.0) -> None:
        """Stop taking messages, send what is queued and mark it (up to ``within`` seconds),
        stop; what is left is the relay's."""
        self._closed = True
        await self.drain(within)
        for task in (self._task, self._marking):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._marking = None


#: the dispatchers attached in this process: per store, per scope (None: any scope)
_dispatchers: weakref.WeakKeyDictionary[PostgresStore, dict[str | None, list[OutboxDispatcher]]]
_dispatchers = weakref.WeakKeyDictionary()
_warned: set[tuple[int, str]] = set()


def attach_dispatcher(
    store: PostgresStore,
    sender: OutboxSender,
    scopes: Collection[str] | None = None,
    **options: Any,
) -> OutboxDispatcher:
    """Send the messages of units of ``scopes`` (None: of any scope without a dispatcher of
    its own) committed in this process on ``store`` through ``sender``, right after their
    COMMIT. The last one attached for a scope serves it; :func:`detach_dispatcher` undoes it.
    ``options``: those of :class:`OutboxDispatcher`."""
    dispatcher = OutboxDispatcher(store, sender, **options)
    by_scope = _dispatchers.setdefault(store, {})
    for scope in [None] if scopes is None else list(scopes):
        by_scope.setdefault(scope, []).append(dispatcher)
    return dispatcher


def detach_dispatcher(store: PostgresStore, dispatcher: OutboxDispatcher) -> None:
    by_scope = _dispatchers.get(store, {})
    for scope in list(by_scope):
        by_scope[scope] = [d for d in by_scope[scope] if d is not dispatcher]
        if not by_scope[scope]:
            del by_scope[scope]


def dispatcher_for(store: PostgresStore, scope: str) -> OutboxDispatcher | None:
    by_scope = _dispatchers.get(store)
    if not by_scope:
        return None
    attached = by_scope.get(scope) or by_scope.get(None)
    return attached[-1] if attached else None


def committed(store: PostgresStore, messages: list[OutgoingMessage]) -> None:
    """The unit(s) that published ``messages`` committed: hand them to the dispatcher of their
    scope. Never blocks, never fails: without a dispatcher, the relay sends them."""
    if not messages:
        return
    scope = messages[0].scope
    dispatcher = dispatcher_for(store, scope)
    if dispatcher is None:
        if (id(store), scope) not in _warned:
            _warned.add((id(store), scope))
            log.warning(
                "scope=%s: no outbox dispatcher attached in this process: outgoing messages "
                "wait for a relay (OutboxRelay, or a runner's)",
                scope,
                extra={"scope": scope},
            )
        return
    route = route_of(dispatcher.sender)
    # (a sender attached meanwhile for another route: its rows are its own relay's)
    dispatcher.enqueue([m for m in messages if m.route == route])


async def backpressure(store: PostgresStore, scope: str) -> None:
    """A consumer of ``scope``, between deliveries: wait while the dispatch it feeds has a long
    backlog (:meth:`OutboxDispatcher.wait_for_room`). Call it holding no pooled connection: a
    unit holding one while it waits would starve the dispatch's own marks."""
    dispatcher = dispatcher_for(store, scope)
    if dispatcher is not None:
        await dispatcher.wait_for_room()


# --- the relay -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RelayReport:
    """What one pass of an :class:`OutboxRelay` did (or, summed, several)."""

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
                await conn.execute("BEGIN")
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
                await commit(conn)
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
    ``dispatch``: other options of :class:`OutboxDispatcher` (``linger``, ``backlog``...);
    ``relay``: other options of :class:`OutboxRelay` (``retention``, ``batch``...)."""

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


def send_all(
    sender: Callable[[OutgoingMessage], Awaitable[Any]],
    messages: Sequence[OutgoingMessage],
    permanent: Callable[[BaseException], bool],
    concurrency: int = 256,
) -> Awaitable[list[BaseException | None]]:
    """A ``send_batch`` for a client that confirms one publish at a time (``send(message)``
    returns once the broker confirmed it): groups run side by side (at most ``concurrency``
    publishes at once), the messages of a group one after the other; after a failure that is
    not for good, the rest of its group is :class:`HeldBack`."""

    async def run() -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        groups: dict[Any, list[int]] = {}
        for i, message in enumerate(messages):
            groups.setdefault(message.group, []).append(i)
        slots = asyncio.Semaphore(concurrency)

        async def one_group(indices: list[int]) -> None:
            failed: BaseException | None = None
            for i in indices:
                if failed is not None:
                    results[i] = HeldBack(f"held back after {failure_text(failed)}")
                    continue
                try:
                    async with slots:
                        await sender(messages[i])
                except Exception as exc:
                    results[i] = exc
                    if not permanent(exc):
                        failed = exc

        await asyncio.gather(*(one_group(indices) for indices in groups.values()))
        return results

    return run()
