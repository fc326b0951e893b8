"""Fault injection for idempotent handlers: real PostgreSQL, faults at every step boundary.

Use it to ask the question that matters: *is my handler still exactly-once when the database
drops, a COMMIT is rolled back, the process dies after the commit, or a publish fails?*

* :class:`FaultyPool` wraps an asyncpg pool. Give the store (``PostgresStore(FaultyPool(pool))``)
  and your handlers its connections; a :class:`Fault` armed on it fires at a statement boundary
  it recognises (:class:`Point`): the claim, the completion, the COMMIT, or any statement you
  match. What fires is real: a terminated connection (before or after the statement reached
  the server), a COMMIT that PostgreSQL answers with ``ROLLBACK`` (an aborted transaction), a
  server error, a cancellation of the running task.
* :func:`deliver` plays a broker: it hands one message to a processor (an
  :class:`~consumer_idem.IdempotentConsumer`) until the verdict is final, redelivering after
  ``retry`` verdicts and after a simulated crash between the commit and the ack, and records
  what a transport would have done (acks, dead letters, notices).
* :func:`check_invariants` asserts the three promises for one message: nothing acked without a
  durable effect, dead letter or notice; the effect at most once; every message ends executed
  once, dead-lettered with a reason, or ``unknown`` with a notice.

Faults are armed per pool and fire ``times`` times (default once), so a redelivery after the
fault meets a healthy database, as it would after a blip.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import asyncpg

from consumer_idem.consumer import Action, Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice


class Point(StrEnum):
    """Statement boundaries the fault layer recognises by the SQL the library sends."""

    CLAIM = "claim"  #: the claim: fast-path BEGIN+claim, reserve(), or a batch's claim
    HANDLER = "handler"  #: a statement of the handler's own (anything not the library's)
    COMPLETE = "complete"  #: an owner's completion, result store, or failure record
    COMMIT = "commit"  #: a statement that ends with COMMIT


class Kind(StrEnum):
    DROP_BEFORE = "drop_before"  #: the connection dies; the statement never reached the server
    DROP_AFTER = "drop_after"  #: the statement ran (a COMMIT committed), then the connection died
    ROLLED_BACK = "rolled_back"  #: COMMIT only: the server answers ROLLBACK (aborted transaction)
    SERVER_ERROR = "server_error"  #: the server refuses the statement (a serialization failure)
    CANCEL = "cancel"  #: the running task is cancelled at this point (shutdown, a timeout)


_CLAIM = re.compile(r"consumer_idem_claim_|\.reserve\(|unnest\(\$2::text\[\], \$3::text\[\]\)")
_COMPLETE = re.compile(
    r"SET status = 'completed'|SET result = |status = 'failed_retryable'|status = 'unknown'"
    r"|consumer_idem_result_|INSERT INTO .*idempotency_records AS t"
)


#: plumbing, not a step: preparing the fast path's statements, opening or abandoning a transaction
_PLUMBING = ("PREPARE ", "SELECT NAME FROM PG_PREPARED_STATEMENTS", "BEGIN", "ROLLBACK")


def point_of(sql: str) -> Point | None:
    """Which boundary a statement is (the last one it touches, for batched statements), or
    ``None`` for plumbing that is no step of its own."""
    text = sql.strip().rstrip(";").upper()
    if text.endswith("COMMIT"):
        return Point.COMMIT
    if text.startswith(_PLUMBING) and "CONSUMER_IDEM_CLAIM_" not in text:
        return None
    if _CLAIM.search(sql):
        return Point.CLAIM
    if _COMPLETE.search(sql) or "idempotency_records" in sql:
        return Point.COMPLETE
    return Point.HANDLER


@dataclass
class Fault:
    """Fire ``kind`` at the ``nth`` statement of boundary ``point`` (then ``times - 1`` more)."""

    point: Point
    kind: Kind
    nth: int = 1
    times: int = 1
    #: how many times it fired
    fired: int = 0
    _seen: int = 0

    def due(self, point: Point | None) -> bool:
        if point is not self.point or self.fired >= self.times:
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
        fault = self._pool._due(point_of(sql))
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
        if fault.kind is Kind.SERVER_ERROR:
            raise asyncpg.SerializationError(f"injected: {fault}")
        if fault.kind is Kind.ROLLED_BACK:
            # abort the open transaction the way a handler's swallowed error does
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await self._conn.execute("SELECT 1/0")
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
    """An asyncpg pool whose connections fire the armed :class:`Fault` s."""

    def __init__(self, pool: asyncpg.Pool) -> None:
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

    def _due(self, point: Point | None) -> Fault | None:
        for fault in self.faults:
            if fault.due(point):
                return fault
        return None

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        return _Acquire(self, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


# --- playing the broker ---------------------------------------------------------------------------


class PublishFailed(Exception):
    """An injected publish failure the broker would not repeat (a timeout, a leader change)."""


class PublishRefusedForGood(Exception):
    """An injected publish refusal that every retry meets (a message too large for the topic)."""


@dataclass
class Delivery:
    """What happened to one message, as a transport would have carried it out."""

    message: ConsumerMessage
    verdicts: list[Verdict] = field(default_factory=list)
    acked: bool = False
    dead_letter_reason: str | None = None
    #: the dead-letter copy went out without its body (it was refused whole for good)
    body_dropped: bool = False
    notices: int = 0
    deliveries: int = 0
    crashes: int = 0

    @property
    def final(self) -> Verdict | None:
        return self.verdicts[-1] if self.verdicts else None


class MemoryTransport:
    """A broker in memory, for :func:`deliver`: it implements the settle path's transport
    contract (:class:`consumer_idem.transports.settle.Transport`), so deliveries are carried out
    by the same :func:`~consumer_idem.transports.settle.settle` as on Kafka and RabbitMQ.
    ``publish_faults`` are raised by the next publishes, one each (``None`` lets one through):
    :class:`PublishFailed` is transient, :class:`PublishRefusedForGood` permanent. An ack of a
    delivery whose dead letter or notice was not confirmed first fails the test on the spot."""

    def __init__(self, store: Any, *, publish_faults: Sequence[BaseException | None] = ()) -> None:
        from consumer_idem.transports.settle import RunnerStats

        self._store = store
        self.publish_faults = list(publish_faults)
        self.stats = RunnerStats()
        #: every step, in order: "published dead letter k", "ack k", "refused notice k" ...
        self.events: list[str] = []
        self.redispatched: list[Notice] = []
        self._confirmed: set[int] = set()  # deliveries whose publish the broker confirmed
        self._waiting_notice: list[Delivery] = []  # the delivery a notice being sent is for

    @property
    def store(self) -> Any:
        return self._store

    def stopping(self) -> bool:
        return False

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PublishRefusedForGood)

    async def _publish(self, what: str) -> None:
        fault = self.publish_faults.pop(0) if self.publish_faults else None
        if fault is not None:
            self.events.append(f"refused {what}")
            raise fault
        self.events.append(f"published {what}")

    async def ack(self, delivery: Delivery) -> None:
        verdict = delivery.final
        needs_publish = verdict is not None and (
            verdict.action is Action.DEAD_LETTER or verdict.reconcile
        )
        if needs_publish and id(delivery) not in self._confirmed:
            raise AssertionError(f"acked before its dead letter or notice was confirmed: {verdict}")
        self.events.append(f"ack {delivery.message.header('idempotency-key')!r}")
        delivery.acked = True

    async def retry_later(self, delivery: Delivery, verdict: Verdict) -> None:
        self.events.append(f"retry {verdict.key}")

    async def give_back(self, delivery: Delivery) -> None:
        self.events.append(f"give back {delivery.final}")

    def dead_letter_destination(self, delivery: Delivery) -> str:
        return "dead-letters"

    def body_size(self, delivery: Delivery) -> int:
        return len(delivery.message.body)

    async def send_dead_letter(
        self, delivery: Delivery, verdict: Verdict, body_dropped: bool
    ) -> None:
        await self._publish(f"dead letter {verdict.key}")
        delivery.dead_letter_reason = verdict.reason or "unknown"
        delivery.body_dropped = body_dropped
        self._confirmed.add(id(delivery))

    def notice_body(self, delivery: Delivery, verdict: Verdict, with_original: bool) -> bytes:
        from consumer_idem.consumer import reconcile_notice

        original = delivery.message if with_original else None
        return reconcile_notice(verdict, original, source="memory" if with_original else None)

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self._publish(f"notice {key}")
        for delivery in self._waiting_notice:
            delivery.notices += 1
            self._confirmed.add(id(delivery))

    async def send_redispatch(self, notice: Notice) -> None:
        await self._publish(f"redispatch {notice.key}")
        self.redispatched.append(notice)

    # what the reconciler and the sweeper use (``settle.Publisher``)
    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool:
        from consumer_idem.transports import settle

        return await settle.publish_notice(self, scope, key, body, hold=False)

    async def redispatch(self, notice: Notice) -> bool:
        from consumer_idem.transports import settle

        return await settle.redispatch(self, notice)


Processor = Callable[[ConsumerMessage], Awaitable[Verdict]]


async def deliver(
    process: Processor,
    message: ConsumerMessage,
    *,
    transport: MemoryTransport | None = None,
    crash_before_ack: int = 0,
    max_deliveries: int = 20,
    retry_cap: float = 0.05,
) -> Delivery:
    """Deliver ``message`` until a verdict settles it, as a broker with at-least-once delivery
    would, carrying each verdict out through :func:`consumer_idem.transports.settle.settle` on
    ``transport`` (a fresh :class:`MemoryTransport` by default): ``retry`` verdicts, exceptions,
    cancellations and publishes that did not complete are redelivered; the first
    ``crash_before_ack`` settling verdicts are lost before they are carried out (the process
    died after the commit), so the message comes again. Waits ``retry_after`` (at most
    ``retry_cap``) between deliveries."""
    from consumer_idem.transports.settle import Settled, settle

    transport = transport or MemoryTransport(None)
    delivery = Delivery(message)
    while delivery.deliveries < max_deliveries:
        delivery.deliveries += 1
        try:
            verdict = await process(message.fresh())
        except (Exception, asyncio.CancelledError):
            delivery.crashes += 1  # the worker died with the delivery unsettled
            continue
        delivery.verdicts.append(verdict)
        if verdict.action is not Action.RETRY and crash_before_ack > 0:
            crash_before_ack -= 1
            delivery.crashes += 1
            continue
        transport._waiting_notice = [delivery]
        settled = await settle(transport, delivery, verdict)
        transport._waiting_notice = []
        if settled is Settled.ACKED:
            return delivery
        await asyncio.sleep(min(verdict.retry_after, retry_cap))
    return delivery


def check_invariants(
    delivery: Delivery,
    *,
    effects: int,
    status: str | None,
    unknown_noticed: bool,
) -> None:
    """The three promises for one delivered message.

    ``effects``: how many times its effect is in the database now; ``status``: its record's
    status (``None`` when there is no record); ``unknown_noticed``: the row will be announced
    without this delivery (it is due for the sweeper, which publishes unpublished notices).
    """
    where = f"{delivery.message!r}: {delivery}"
    # 2. the effect at most once
    assert effects <= 1, f"effect applied {effects} times: {where}"
    # 3. every message ends executed once, dead-lettered with a reason, or unknown with a notice
    assert delivery.acked, f"never settled: {where}"
    if delivery.dead_letter_reason is not None:
        return
    if status == "unknown":
        assert unknown_noticed or delivery.notices, f"unknown without a notice: {where}"
        return
    # 1. acked as done: the effect is durable, with its completed record
    assert status == "completed", f"acked with the record {status}: {where}"
    assert effects == 1, f"acked as done without its effect: {where}"


def matrix(points: Sequence[Point], kinds: Sequence[Kind]) -> list[Fault]:
    """Every meaningful (point, kind) pair: ROLLED_BACK only makes sense at a COMMIT."""
    return [
        Fault(point, kind)
        for point in points
        for kind in kinds
        if kind is not Kind.ROLLED_BACK or point is Point.COMMIT
    ]
