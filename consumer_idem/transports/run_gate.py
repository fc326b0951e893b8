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
    """Many handlers at once (`shared`), or one alone (`alone`).

    Entering and leaving `shared` while no suspect is about costs no wait and no lock
    (a check and a counter: this is every first delivery's path); nothing is awaited on the
    way out, so a cancelled handler never leaves the gate closed."""

    def __init__(self) -> None:
        self._running = 0  #: handlers in :meth:`shared`
        self._idle = asyncio.Event()  #: set while none is
        self._idle.set()
        self._suspects = 0  #: handlers running or waiting to run alone
        self._open = asyncio.Event()  #: set while there are none (shared ones may start)
        self._open.set()
        self._turn = asyncio.Lock()  #: suspects run one after another

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if not self._running:
                self._idle.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        self._suspects += 1
        self._open.clear()  # new shared ones wait: suspects are rare, and go first
        try:
            async with self._turn:
                while self._running:
                    await self._idle.wait()
                yield
        finally:
            self._suspects -= 1
            if not self._suspects:
                self._open.set()


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RunGate] = weakref.WeakKeyDictionary()


def process_gate() -> RunGate:
    """The gate of the running event loop (the process's consumers)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = RunGate()
    return gate
