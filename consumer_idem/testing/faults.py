"""Faults at the statement boundaries of a real PostgreSQL connection.

[`FaultyPool`][consumer_idem.testing.faults.FaultyPool] wraps an asyncpg pool. Give the store
(``PostgresStore(FaultyPool(pool))``)
and your handlers its connections; a [`Fault`][consumer_idem.testing.faults.Fault] armed on it fires
at a statement boundary
it recognises ([`Point`][consumer_idem.testing.faults.Point]): the claim, the completion, the
COMMIT, a statement of the
handler's own, optionally narrowed to statements matching a pattern. What fires is real: a
terminated connection (before or after the statement reached the server), a COMMIT that
PostgreSQL answers with ``ROLLBACK`` (an aborted transaction), a statement the server refuses
(aborting the transaction it was in), a cancellation of the running task.

Faults are armed per pool and fire ``times`` times (default once), so a redelivery after the
fault meets a healthy database, as it would after a blip.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import asyncpg


class Point(StrEnum):
    """Statement boundaries the fault layer recognises by the SQL the library sends."""

    CLAIM = "claim"  #: the claim: fast-path BEGIN+claim, reserve(), or a batch's claim
    HANDLER = "handler"  #: a statement of the handler's own (anything not the library's)
    COMPLETE = "complete"  #: an owner's completion, result store, or failure record
    COMMIT = "commit"  #: a statement that ends with COMMIT (or carries the next unit's claim)


class Kind(StrEnum):
    """What happens at the boundary."""

    DROP_BEFORE = "drop_before"  #: the connection dies; the statement never reached the server
    DROP_AFTER = "drop_after"  #: the statement ran (a COMMIT committed), then the connection died
    ROLLED_BACK = "rolled_back"  #: COMMIT only: the server answers ROLLBACK (aborted transaction)
    #: the server refuses the statement (a serialization failure), which aborts the transaction
    #: it was in, as a real refusal does
    SERVER_ERROR = "server_error"
    CANCEL = "cancel"  #: the running task is cancelled at this point (shutdown, a timeout)


_CLAIM = re.compile(r"consumer_idem_claim[_$]|\.reserve\(|unnest\(\$2::text\[\], \$3::text\[\]\)")
_COMPLETE = re.compile(
    r"SET status = 'completed'|SET result = |status = 'failed_retryable'|status = 'unknown'"
    r"|consumer_idem_result[_$]|INSERT INTO .*idempotency_records AS t"
)

#: plumbing, not a step: preparing the fast path's statements, opening or abandoning a
#: transaction, a handler's savepoints (the statement inside one is the step)
_PLUMBING = (
    "PREPARE ",
    "SELECT NAME FROM PG_PREPARED_STATEMENTS",
    "BEGIN",
    "ROLLBACK",
    "SAVEPOINT ",
    "RELEASE SAVEPOINT ",
)

#: the library's own COMMIT of a transactional unit: it checks the transaction's mark first
#: (``consumer_idem.commit.check_sql``, or its prepared form); a handler's own bare ``COMMIT``
#: does not
LIBRARY_COMMIT = r"consumer_idem\.tx|EXECUTE consumer_idem_check(done)?[_$]"


def point_of(sql: str) -> Point | None:
    """Which boundary a statement is (the last one it touches, for batched statements), or
    ``None`` for plumbing that is no step of its own."""
    text = sql.strip().rstrip(";").upper()
    if text.endswith("COMMIT") or ("; COMMIT; BEGIN; " in text and "CONSUMER_IDEM_CLAIM" in text):
        # (a unit's COMMIT with the next unit's BEGIN and claim after it: the COMMIT is the step)
        return Point.COMMIT
    if text.startswith(_PLUMBING) and "CONSUMER_IDEM_CLAIM" not in text:
        return None
    if _CLAIM.search(sql):
        return Point.CLAIM
    if _COMPLETE.search(sql) or "idempotency_records" in sql:
        return Point.COMPLETE
    return Point.HANDLER


@dataclass
class Fault:
    """Fire ``kind`` at the ``nth`` statement of boundary ``point`` (then ``times - 1`` more).
    ``match``: a regular expression the statement must contain as well (e.g.
    `LIBRARY_COMMIT`, to skip a handler's own COMMIT)."""

    point: Point
    kind: Kind
    nth: int = 1
    times: int = 1
    match: str | None = None
    #: how many times it fired
    fired: int = 0
    _seen: int = 0

    def due(self, point: Point | None, sql: str = "") -> bool:
        """Whether this fault fires at a statement of ``point`` (counting it when it matches)."""
        if point is not self.point or self.fired >= self.times:
            return False
        if self.match is not None and not re.search(self.match, sql):
            return False
        self._seen += 1
        return self._seen >= self.nth

    def __str__(self) -> str:
        return f"{self.kind} at {self.point}"


class FaultyConnection:
    """An asyncpg connection whose statements pass through the armed faults."""

    def __init__(self, conn: Any, pool: FaultyPool) -> None:
        self._conn = conn
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def _run(self, sql: str, call: Callable[[], Awaitable[Any]]) -> Any:
        fault = self._pool._due(point_of(sql), sql)
        if fault is None:
            return await call()
        fault.fired += 1
        self._pool.log.append(str(fault))
        if fault.kind is Kind.DROP_BEFORE:
            self._conn.terminate()
            raise asyncpg.ConnectionDoesNotExistError(f"injected: {fault}")
        if fault.kind is Kind.CANCEL:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # the cancellation lands here, at the boundary
        if fault.kind in (Kind.ROLLED_BACK, Kind.SERVER_ERROR):
            # abort the open transaction (if any) the way a failed statement does
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await self._conn.execute("SELECT 1/0")
        if fault.kind is Kind.SERVER_ERROR:
            raise asyncpg.SerializationError(f"injected: {fault}")
        if fault.kind is Kind.ROLLED_BACK:
            return await call()
        await call()  # DROP_AFTER: it happened; the caller never hears so
        self._conn.terminate()
        raise asyncpg.ConnectionDoesNotExistError(f"injected: {fault}")

    async def execute(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(sql, lambda: self._conn.execute(sql, *args, **kwargs))

    async def fetch(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(sql, lambda: self._conn.fetch(sql, *args, **kwargs))

    async def fetchrow(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(sql, lambda: self._conn.fetchrow(sql, *args, **kwargs))

    async def fetchval(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(sql, lambda: self._conn.fetchval(sql, *args, **kwargs))

    async def executemany(self, sql: str, args: Any, **kwargs: Any) -> Any:
        return await self._run(sql, lambda: self._conn.executemany(sql, args, **kwargs))


class _Acquire:
    def __init__(self, pool: FaultyPool, timeout: float | None) -> None:
        self._pool = pool
        self._inner = pool.pool.acquire(timeout=timeout)

    async def __aenter__(self) -> FaultyConnection:
        return FaultyConnection(await self._inner.__aenter__(), self._pool)

    async def __aexit__(self, *exc: Any) -> None:
        await self._inner.__aexit__(*exc)


class FaultyPool:
    """An asyncpg pool whose connections fire the armed
    [`Fault`][consumer_idem.testing.faults.Fault] s."""

    def __init__(self, pool: Any) -> None:
        """``pool``: an asyncpg ``Pool``, or any pool the store takes (``ConnectionPool``)."""
        self.pool = pool
        self.faults: list[Fault] = []
        #: every fault fired, in order
        self.log: list[str] = []

    def arm(self, *faults: Fault) -> None:
        """Arm these faults (their counts start again: one fault may serve many cases)."""
        for fault in faults:
            fault.fired = fault._seen = 0
        self.faults = list(faults)

    def disarm(self) -> None:
        self.faults = []

    def _due(self, point: Point | None, sql: str = "") -> Fault | None:
        for fault in self.faults:
            if fault.due(point, sql):
                return fault
        return None

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        return _Acquire(self, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def matrix(points: Sequence[Point], kinds: Sequence[Kind]) -> list[Fault]:
    """Every meaningful (point, kind) pair: ROLLED_BACK only makes sense at a COMMIT."""
    return [
        Fault(point, kind)
        for point in points
        for kind in kinds
        if kind is not Kind.ROLLED_BACK or point is Point.COMMIT
    ]
