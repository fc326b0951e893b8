"""Right after the COMMIT: the [`OutboxDispatcher`][consumer_idem.outbox_dispatch.OutboxDispatcher]
attached to a store sends what its
process's units committed, and the back-pressure that keeps its queue bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import deque
from collections.abc import Collection
from typing import Any

from consumer_idem.errors import (
    ConsumerIdemError,
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
from consumer_idem.stores.postgres.outbox import (
    OutgoingMessage,
)
from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.outbox")


class OutboxDispatcher:
    """Sends the messages of the units this process commits, right after each COMMIT, and
    marks them sent. Messages wait in an in-memory queue. While more than ``backlog`` wait, a
    consumer waits before its next delivery (at most ``max_wait`` seconds, holding no pooled
    connection of its own: [`backpressure`][consumer_idem.outbox_dispatch.backpressure]), so it
    slows to the pace of the broker instead
    of filling memory. Beyond ``max_queued`` (the broker hangs) messages are left to the relay,
    as are those a crash or an outage leaves; nothing is lost, it is only later.

    Sends are batched: a send takes whatever was committed within ``linger`` seconds (or
    ``batch`` messages, whichever comes first), and whatever commits while it is in flight
    goes in the next one. One broker request per message would cost the broker (and this
    process) as much as the unit itself; a few milliseconds of latency buys several messages
    per request. Attach it with
    [`attach_dispatcher`][consumer_idem.outbox_dispatch.attach_dispatcher] (a runner does it for
    you)."""

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
    COMMIT. The last one attached for a scope serves it; `detach_dispatcher` undoes it.
    ``options``: those of [`OutboxDispatcher`][consumer_idem.outbox_dispatch.OutboxDispatcher]."""
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
    backlog (`OutboxDispatcher.wait_for_room`). Call it holding no pooled connection: a unit
    holding one while it waits would starve the dispatch's own marks."""
    dispatcher = dispatcher_for(store, scope)
    if dispatcher is not None:
        await dispatcher.wait_for_room()
