"""Fail-open, narrowly: when a route may run unprotected while the store is down, and the
registries of keys this process holds that keep such a run from ever being a duplicate."""

from __future__ import annotations

import errno
import socket
import time
from collections import OrderedDict

import asyncpg

from consumer_idem.errors import StoreUnavailable

#: keys whose endpoint ran in this process without a settled record: at most this many are
#: remembered (oldest dropped first), each for the lease or 5 minutes, whichever is longer
UNSETTLED_MAX = 10_000
UNSETTLED_MIN_TTL = 300.0

#: (record scope, key)
Held = tuple[str, str]

#: connect() errors that prove the database host cannot be reached at all: nobody connects
_UNREACHABLE = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH)


def outage_proven(exc: BaseException) -> bool:
    """Does ``exc`` (a store error, with its causes) prove the database cannot be reached?

    Only errors that can happen solely while *opening* a connection count: the connection was
    refused, the network or host is unreachable, the host name does not resolve, or the
    server says it does not accept connections now (starting up, shutting down). Then no
    statement of this request reached the database. A timeout proves nothing (a pool
    exhausted by the requests holding keys, a slow server: the store is up and someone may
    hold this very key), and neither does a connection lost mid-statement (the statement may
    have run) or a server refusing more clients (it serves others)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror | asyncpg.CannotConnectNowError):
            return True
        if isinstance(current, ConnectionRefusedError):
            return True
        if type(current) is OSError and current.errno in _UNREACHABLE:
            return True
        current = current.__cause__  # what the store wrapped: never an unrelated context
    return False


def may_bypass(exc: BaseException, *, ran: bool, held_elsewhere: bool, consulted: bool) -> bool:
    """Fail-open skips protection only when nothing can have happened and nobody can hold
    the key: the endpoint has not run, no store statement returned a decision (the key
    was not seen held, replayed, or in any state), and the failure proves the database
    cannot be reached at all (a refused connection, an unknown host), never a timeout."""
    return (
        not ran
        and not held_elsewhere
        and not consulted
        and isinstance(exc, StoreUnavailable)
        and outage_proven(exc)
    )


class HeldKeys:
    """The keys one middleware holds right now in this process (claimed until settled, or
    run bypassed), those of them run unprotected (fail-open), and those whose endpoint ran
    here without a settled record (an outcome unknown, a bypassed run): fail-open never lets
    those through again."""

    def __init__(self, lease: float) -> None:
        self._running: dict[Held, int] = {}
        self._bypassed: dict[Held, int] = {}
        #: key -> when it is forgotten
        self._unsettled: OrderedDict[Held, float] = OrderedDict()
        self._ttl = max(lease, UNSETTLED_MIN_TTL)

    def hold(self, held: Held, *, bypassed: bool = False) -> None:
        self._running[held] = self._running.get(held, 0) + 1
        if bypassed:
            self._bypassed[held] = self._bypassed.get(held, 0) + 1

    def release(self, held: Held) -> None:
        for registry in (self._running, self._bypassed):
            if held in registry:
                left = registry.pop(held) - 1
                if left:
                    registry[held] = left

    def running(self, held: Held) -> bool:
        """Does a request of this process hold the key (protected or not)?"""
        return held in self._running

    def bypassed(self, held: Held) -> bool:
        """Does a request of this process run the key unprotected, in no record?"""
        return held in self._bypassed

    def settled(self, held: Held) -> None:
        self._unsettled.pop(held, None)

    def remember_unsettled(self, held: Held) -> None:
        self._unsettled.pop(held, None)
        self._unsettled[held] = time.monotonic() + self._ttl
        while len(self._unsettled) > UNSETTLED_MAX:
            self._unsettled.popitem(last=False)

    def unsettled(self, held: Held) -> bool:
        until = self._unsettled.get(held)
        if until is None:
            return False
        if until < time.monotonic():
            del self._unsettled[held]
            return False
        return True
