"""Waiting for another owner of a key (opt-in; HTTP ``wait=``): `waiters_for` gives the
store's `CompletionWaiters`. While any request waits, one pooled connection LISTENs; the
transaction that settles a key NOTIFYs in its own COMMIT (`notify_sql`, only where
waiting is enabled), so a waiter neither polls the database hard nor holds a connection.
Re-exported from ``consumer_idem.claim``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

from consumer_idem.claim_commit import conn_closed
from consumer_idem.stores.postgres.migrate import per_schema_name
from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.claim")


def _digest(scope: str, key: str) -> str:
    return hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()[:32]


def _channel(store: PostgresStore) -> str:
    # within Postgres' 63 bytes, and one of its own for each schema
    return per_schema_name("consumer_idem_done", store.schema)


def notify_sql(store: PostgresStore, scope: str, key: str) -> str:
    """The NOTIFY that tells waiters (scope, key) was settled. Sent inside the settling
    transaction it is delivered at COMMIT, and never if the transaction rolls back."""
    return f"NOTIFY \"{_channel(store)}\", '{_digest(scope, key)}'"


async def notify_settled(store: PostgresStore, scope: str, key: str, conn: Any = None) -> None:
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
    (`poll_cap`).
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
                # shielded: a waiter cancelled here (a request's timeout) still gives up its
                # share of the listener, or the connection would stay out of the pool
                await asyncio.shield(self._unlisten())

    def _notified(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        for event in self._events.get(str(payload), ()):
            event.set()

    async def _listen(self) -> None:
        async with self._lock:
            if self._conn is not None and conn_closed(self._conn):
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
                    # classified while still lent: a read-only node's session is closed here
                    error = store.error_for("listen", exc, conn=conn)
                    await self._give_back(conn)
                    raise error from exc
                except BaseException:  # cancelled while listening: the pool takes it back
                    await asyncio.shield(self._give_back(conn))
                    raise
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
            if not conn_closed(conn):
                await conn.remove_listener(self.channel, self._notified)
        except Exception:
            log.debug("UNLISTEN failed", exc_info=True)
        finally:
            await self._give_back(conn)

    async def _give_back(self, conn: Any) -> None:
        # a connection that breaks as the pool resets it is closed by the pool, which then
        # raises the driver's error: nothing of a waiter's is lost, so it is only logged
        try:
            await self.store.pool.release(conn)
        except Exception:
            log.debug("giving the listener's connection back failed", exc_info=True)


_waiters: weakref.WeakKeyDictionary[PostgresStore, CompletionWaiters] = weakref.WeakKeyDictionary()


def waiters_for(store: PostgresStore) -> CompletionWaiters:
    """The store's waiters (one listening connection per store and process)."""
    waiters = _waiters.get(store)
    if waiters is None:
        waiters = _waiters[store] = CompletionWaiters(store)
    return waiters
