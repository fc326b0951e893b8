"""Handlers of one process run many at once, or one suspect alone (``delivery_budget``).

A delivery budget charges a crash to the delivery that was running when the process died. That
is only true if nothing else ran beside it: a poison delivered for the first time, running in
parallel with a redelivered good message, would kill the process and have the good one charged
for it, again and again until the good one is dead-lettered without ever failing. A crash
kills every consumer of the process, so the gate is the process's (one per event loop), shared
by all runners: a suspect waits for the handlers running to finish, and holds new ones back
(suspects go first: they are rare) until its own run is over.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RunGate:
    """Many handlers at once (:meth:`shared`), or one alone (:meth:`alone`)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._running = 0  #: handlers in :meth:`shared`
        self._alone = False  #: a handler in :meth:`alone`
        self._waiting = 0  #: handlers waiting to run alone (they hold new shared ones back)

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone and not self._waiting)
            self._running += 1
        try:
            yield
        finally:
            async with self._changed:
                self._running -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        async with self._changed:
            self._waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._alone and not self._running)
            except BaseException:  # cancelled: the shared ones it held back may go
                self._waiting -= 1
                self._changed.notify_all()
                raise
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone = False
                self._changed.notify_all()


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RunGate] = weakref.WeakKeyDictionary()


def process_gate() -> RunGate:
    """The gate of the running event loop (the process's consumers)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = RunGate()
    return gate
