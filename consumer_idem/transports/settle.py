"""The settle path: the one place where a delivery's [`Verdict`][consumer_idem.Verdict] is carried
out.

Every transport (``KafkaRunner``, ``RabbitRunner``, the FastStream middleware) implements the
small `Transport` contract and calls `settle`; the reconciler's re-dispatch and the
sweeper's notices go through `redispatch` and `publish_notice`. The rule, written once:

* ``RETRY``: never acked; the transport delivers it again later (`Transport.retry_later`).
* ``DEAD_LETTER``: the copy is published and *confirmed by the broker*, then the delivery is acked.
* a reconciliation notice (``verdict.reconcile``): published and confirmed, then acked.
* anything else: acked (the effect committed before the verdict was made).

An outcome that is ``unknown`` (the delivery parked its key, or met it parked) is acked only once
its original message is kept durably (`keep_original`: an unarmed row of the re-dispatch
outbox, armed by a "not executed" resolution). Otherwise acking it could lose the only copy of
the work. If it cannot be kept (the store is down) the delivery is not acked: it comes again.

A publish is retried with backoff while its error is transient. A publish that did not complete
(the runner is stopping) leaves the delivery unacked (`Transport.give_back`), so the broker
delivers it again. A *permanent* error (the broker will refuse the same bytes again, e.g. Kafka's
``MessageSizeTooLargeError``) takes a fallback that still leaves a durable trace:

* a dead letter goes out without its body, with its reason, its original coordinates and
  ``x-dead-letter-body-dropped: <size>`` (counted as ``dead_letter_body_dropped``);
* a notice goes out without the original message it carries (``notice_body_dropped``): the
  ``unknown`` row stays the truth, and the original kept in the store before the ack is what a
  "not executed" answer re-dispatches.

If even the fallback is refused for good (the destination itself is unusable: no such queue, not
authorised), the delivery is *held*: not acked, retried with backoff, an error logged each time
and counted as ``dead_letter_failed`` / ``notice_failed``, until an operator fixes the
destination or the runner stops. Acking without any durable trace is never an option.

Waiting is not failing: a verdict to retry because the store is unavailable or another owner
holds the key (`is_wait`) is retried in-process by `process_holding`, with the
delivery in hand, so it does not spend a broker's delivery budget (RabbitMQ quorum queues count
every hand-back in ``x-delivery-count``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from consumer_idem import tracing
from consumer_idem.backoff import Backoff
from consumer_idem.consumer import Action, Verdict
from consumer_idem.errors import (
    ConsumerIdemError,
    PublishRefused,
    StoreUnavailable,
)
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice, decode_notice
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import OutcomeKind, Status

log = logging.getLogger("consumer_idem.transports.settle")

#: the header a body-less dead-letter copy carries: the size in bytes of the dropped body
DEAD_LETTER_BODY_DROPPED = "x-dead-letter-body-dropped"
#: ``x-dead-letter-error`` is cut to this many characters (headers are not log files)
MAX_ERROR_HEADER = 1000
#: verdict reasons that mean "wait", not "the handler failed"
WAIT_REASONS = frozenset({"store_unavailable", "in_progress"})
#: how publishes are retried while their error is transient
PUBLISH_BACKOFF = Backoff(0.2, 10.0)
#: seconds before a delivery whose original could not be kept is processed again
KEEP_RETRY = 1.0

D = TypeVar("D", contravariant=True)


@dataclass
class RunnerStats:
    """What a transport runner did, for logs, the demo and tests."""

    processed: int = 0  #: deliveries settled (acked or dead-lettered)
    executed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    reconcile_published: int = 0
    retries: int = 0  #: retry-laters and in-process waits
    commits: int = 0
    failures: int = 0  #: unexpected exceptions (logged; the delivery was handed back)


class Settled(StrEnum):
    ACKED = "acked"  #: acked (after its dead letter or notice was confirmed, if any)
    RETRY = "retry"  #: handed back to be delivered again later; not acked
    UNSETTLED = "unsettled"  #: stopping before a publish was confirmed; not acked


class Transport(Protocol[D]):
    """What a transport provides for one kind of delivery ``D``. Every ``send_*`` returns only
    once the broker confirmed the publish, and raises otherwise."""

    stats: RunnerStats

    @property
    def store(self) -> PostgresStore: ...

    def stopping(self) -> bool: ...

    def permanent(self, exc: BaseException) -> bool:
        """Whether a publish error will recur for the same bytes and destination."""
        ...

    async def ack(self, delivery: D) -> None: ...

    async def retry_later(self, delivery: D, verdict: Verdict) -> None:
        """Not acked: make the delivery come again after ``verdict.retry_after``."""
        ...

    async def give_back(self, delivery: D) -> None:
        """Not acked: the runner is stopping before the delivery could be settled."""
        ...

    def dead_letter_destination(self, delivery: D) -> str: ...

    def body_size(self, delivery: D) -> int: ...

    async def send_dead_letter(self, delivery: D, verdict: Verdict, body_dropped: bool) -> None:
        """Publish the dead-letter copy; without the body when ``body_dropped``."""
        ...

    def notice_body(self, delivery: D, verdict: Verdict, with_original: bool) -> bytes: ...

    async def send_notice(self, scope: str, key: str, body: bytes) -> None: ...

    async def send_redispatch(self, notice: Notice) -> None: ...


class Publisher(Protocol):
    """What the reconciler and the sweeper need from a transport runner."""

    async def publish_notice(self, scope: str, key: str, body: bytes) -> bool: ...

    async def redispatch(self, notice: Notice) -> bool: ...


def is_wait(verdict: Verdict) -> bool:
    """A retry that waits for the store or for another owner: no handler failed."""
    return verdict.action is Action.RETRY and verdict.reason in WAIT_REASONS


def error_header(verdict: Verdict) -> str | None:
    """The ``x-dead-letter-error`` value of a verdict, cut to `MAX_ERROR_HEADER`."""
    if not verdict.error:
        return None
    text = verdict.error
    return text if len(text) <= MAX_ERROR_HEADER else text[: MAX_ERROR_HEADER - 1] + "…"


async def pause(seconds: float, stopping: Callable[[], bool]) -> None:
    """Sleep up to ``seconds``, returning early once ``stopping()``."""
    deadline = time.monotonic() + seconds
    while not stopping():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.1))


async def publish_until_sent(
    send: Callable[[], Awaitable[Any]],
    *,
    destination: str,
    stopping: Callable[[], bool],
    permanent: Callable[[BaseException], bool] = lambda exc: False,
    backoff: Backoff = PUBLISH_BACKOFF,
) -> bool:
    """Publish with backoff until the broker confirms it: a delivery must not be acked before
    its dead letter or notice is durable. False only when stopping interrupted it; raises
    [`PublishRefused`][consumer_idem.PublishRefused] for a permanent error."""
    attempt = 0
    while True:
        try:
            await send()
            return True
        except Exception as exc:
            if permanent(exc):
                raise PublishRefused(destination, exc) from exc
            if stopping():
                return False
            attempt += 1
            delay = backoff.delay(attempt)
            log.warning("publish to %s failed (%r); retrying in %.1fs", destination, exc, delay)
            await pause(delay, stopping)


def is_unknown(verdict: Verdict) -> bool:
    """An ack of a delivery whose outcome is ``unknown`` (parked now, or met parked)."""
    outcome = verdict.outcome
    return (
        verdict.action is Action.ACK
        and verdict.key is not None
        and outcome is not None
        and outcome.kind is OutcomeKind.UNKNOWN
    )


async def keep_original(transport: Transport[D], delivery: D, verdict: Verdict) -> Verdict | None:
    """Before acking a delivery whose outcome is ``unknown``: keep its original message in the
    store (`RedispatchOutbox.keep_original`), so a "not executed" answer can re-dispatch it
    whichever delivery was acked. Returns None when the delivery may be acked now, or the
    retry verdict to carry out instead: the store is down (not acked: it comes again and is
    kept then), or the record was resolved "not executed" meanwhile (it must run, not be acked).

    A store without the outbox (the Redis store: reconciliation is Postgres-only) keeps
    nothing; the delivery is acked as before."""
    outbox = getattr(transport.store, "redispatch", None)
    if outbox is None:
        return None
    keep = outbox.keep_original
    assert verdict.key is not None
    extra = {"scope": verdict.scope, "key": verdict.key}
    notice = decode_notice(ConsumerMessage(transport.notice_body(delivery, verdict, True)))
    if not notice.original:
        log.error(
            "scope=%s key=%s: the original of an unknown outcome is not in hand; acking it",
            verdict.scope,
            verdict.key,
            extra=extra,
        )
        return None
    try:
        status = await keep(verdict.scope, verdict.key, notice)
    except ConsumerIdemError as exc:
        log.log(
            logging.WARNING if isinstance(exc, StoreUnavailable) else logging.ERROR,
            "scope=%s key=%s: the original of an unknown outcome could not be kept (%s); the "
            "delivery is not acked and comes again",
            verdict.scope,
            verdict.key,
            exc,
            extra=extra,
        )
        return replace(
            verdict,
            action=Action.RETRY,
            reason="store_unavailable",
            retry_after=KEEP_RETRY,
            reconcile=False,
        )
    if status in (Status.UNKNOWN, Status.COMPLETED):
        return None
    log.info(
        "scope=%s key=%s: the record was settled meanwhile (%s): the delivery is processed "
        "again, not acked",
        verdict.scope,
        verdict.key,
        status,
        extra=extra,
    )
    return replace(
        verdict, action=Action.RETRY, reason="resolved_meanwhile", retry_after=0.1, reconcile=False
    )


async def check_store(store: PostgresStore) -> None:
    """Before a runner consumes: a missing or outdated schema stops it at once
    ([`SchemaMissing`][consumer_idem.errors.SchemaMissing], naming ``consumer-idem migrate``); an
    unreachable database does not, the runner waits for it like for any outage."""
    try:
        await store.check_schema()
    except StoreUnavailable as exc:
        log.warning("store unreachable at start (%s); deliveries wait for it", exc)


async def notice_published(stats: RunnerStats, store: PostgresStore, scope: str, key: str) -> None:
    """Bookkeeping after a reconciliation notice was published (every transport)."""
    stats.reconcile_published += 1
    with contextlib.suppress(Exception):  # the sweeper republishes if this is lost
        await store.reconciliation.mark_reconcile_published(scope, key)


async def _held(
    transport: Transport[Any], what: str, scope: str, metric: str, attempt: Callable[[], Any]
) -> bool:
    """Run ``attempt`` until it completes; while it is refused for good, hold: never ack,
    log an error, count ``metric``, back off. False when stopping."""
    refusals = 0
    while True:
        try:
            sent: bool = await attempt()
            return sent
        except PublishRefused as exc:
            refusals += 1
            transport.store.metrics.inc(metric, scope)
            delay = PUBLISH_BACKOFF.delay(refusals + 3)
            log.error(
                "scope=%s: %s cannot be published at all (%s); the delivery stays unacked, "
                "retrying in %.1fs: fix the destination",
                scope,
                what,
                exc,
                delay,
                extra={"scope": scope},
            )
            if transport.stopping():
                return False
            await pause(delay, transport.stopping)


async def dead_letter(transport: Transport[D], delivery: D, verdict: Verdict) -> bool:
    """Publish the dead-letter copy of ``delivery`` (confirmed); see the module docstring for
    what a permanent refusal does. False only when stopping interrupted it."""
    destination = transport.dead_letter_destination(delivery)
    scope = verdict.scope

    def send(v: Verdict, body_dropped: bool) -> Callable[[], Awaitable[bool]]:
        return lambda: publish_until_sent(
            lambda: transport.send_dead_letter(delivery, v, body_dropped),
            destination=destination,
            stopping=transport.stopping,
            permanent=transport.permanent,
        )

    async def whole_or_without_body() -> bool:
        try:
            return await send(verdict, False)()
        except PublishRefused as exc:
            log.error(
                "scope=%s key=%s: the dead-letter copy for %s can never be published whole "
                "(%r); publishing it without its body (%d bytes dropped): the original stays "
                "findable by its coordinates",
                scope,
                verdict.key,
                destination,
                exc.cause,
                transport.body_size(delivery),
                extra={"scope": scope, "key": verdict.key},
            )
            why = f"body dropped: {exc.cause!r}"
            bare = replace(verdict, error=f"{verdict.error}; {why}" if verdict.error else why)
            sent = await send(bare, True)()
            if sent:
                transport.store.metrics.inc("dead_letter_body_dropped", scope)
            return sent

    with tracing.publishing("dead_letter", destination):
        sent = await _held(
            transport,
            f"the dead letter to {destination}",
            scope,
            "dead_letter_failed",
            whole_or_without_body,
        )
    if sent:
        transport.stats.dead_lettered += 1
        log.warning(
            "scope=%s key=%s: dead-lettered to %s: %s%s",
            scope,
            verdict.key,
            destination,
            verdict.reason,
            f" ({verdict.error})" if verdict.error else "",
            extra={"scope": scope, "key": verdict.key},
        )
    return sent


async def publish_notice(
    transport: Transport[Any],
    scope: str,
    key: str,
    body: bytes,
    bare: bytes | None = None,
    *,
    hold: bool = True,
) -> bool:
    """Publish a reconciliation notice (confirmed) and record that it was published. A notice
    refused for good goes again as ``bare`` (without the original message), if given. With
    ``hold`` (a delivery waits on it) a notice refused even so is retried until stopping;
    without (the sweeper), [`PublishRefused`][consumer_idem.PublishRefused] is raised."""
    destination = "the reconciliation notice"

    def send(payload: bytes) -> Awaitable[bool]:
        return publish_until_sent(
            lambda: transport.send_notice(scope, key, payload),
            destination=destination,
            stopping=transport.stopping,
            permanent=transport.permanent,
        )

    async def with_or_without_original() -> bool:
        try:
            return await send(body)
        except PublishRefused as exc:
            if bare is None or bare == body:
                raise
            log.error(
                "scope=%s key=%s: the reconciliation notice can never be published with its "
                "original message (%r); publishing it without (the original is kept in the "
                "store, for a 'not executed' answer to re-dispatch)",
                scope,
                key,
                exc.cause,
                extra={"scope": scope, "key": key},
            )
            sent = await send(bare)
            if sent:
                transport.store.metrics.inc("notice_body_dropped", scope)
            return sent

    with tracing.publishing("notice", None):
        if hold:
            sent = await _held(
                transport, destination, scope, "notice_failed", with_or_without_original
            )
        else:
            sent = await with_or_without_original()
    if sent:
        await notice_published(transport.stats, transport.store, scope, key)
    return sent


async def redispatch(transport: Transport[Any], notice: Notice) -> bool:
    """Send a notice's original message back to where it came from (confirmed). False when
    there is nothing to send or stopping interrupted it; raises
    [`PublishRefused`][consumer_idem.PublishRefused]."""
    if notice.source is None or not notice.original:
        return False
    with tracing.publishing("redispatch", notice.source):
        return await publish_until_sent(
            lambda: transport.send_redispatch(notice),
            destination=notice.source,
            stopping=transport.stopping,
            permanent=transport.permanent,
        )


def count_ack(stats: RunnerStats, verdict: Verdict) -> None:
    """Count an ack that has nothing to publish first: a run, or a duplicate answered."""
    if verdict.duplicate:
        stats.duplicates += 1
    else:
        stats.executed += 1


async def settle(transport: Transport[D], delivery: D, verdict: Verdict) -> Settled:
    """Carry out ``verdict`` for ``delivery``: keep the original of an ``unknown`` outcome,
    publish durably, then ack; never ack a retry, and never ack when a publish or the keeping
    did not complete."""
    with tracing.settling(verdict) as span:
        settled = await _settle(transport, delivery, verdict)
        span.describe(settled)
    return settled


async def _settle(transport: Transport[D], delivery: D, verdict: Verdict) -> Settled:
    stats = transport.stats
    if is_unknown(verdict):
        instead = await keep_original(transport, delivery, verdict)
        if instead is not None:
            verdict = instead
    if verdict.action is Action.RETRY:
        stats.retries += 1
        await transport.retry_later(delivery, verdict)
        return Settled.RETRY
    if verdict.action is Action.DEAD_LETTER:
        sent = await dead_letter(transport, delivery, verdict)
    elif verdict.reconcile:
        assert verdict.key is not None
        sent = await publish_notice(
            transport,
            verdict.scope,
            verdict.key,
            transport.notice_body(delivery, verdict, True),
            transport.notice_body(delivery, verdict, False),
        )
    else:
        sent = True
        count_ack(stats, verdict)
    if not sent:
        await transport.give_back(delivery)
        return Settled.UNSETTLED
    await transport.ack(delivery)
    stats.processed += 1
    return Settled.ACKED


class Holding:
    """A delivery held in hand while its verdict is a wait (`is_wait`): at most
    ``max_hold`` seconds, and not once stopping. For a worker that runs each try itself::

        holding = Holding(stats, stopping, max_hold)
        verdict = await consumer.process(view())
        while await holding.again(verdict):
            verdict = await consumer.process(view())
    """

    __slots__ = ("max_hold", "started", "stats", "stopping")

    def __init__(
        self, stats: RunnerStats, stopping: Callable[[], bool], max_hold: float | None
    ) -> None:
        self.stats = stats
        self.stopping = stopping
        self.max_hold = max_hold
        self.started = time.monotonic()

    async def again(self, verdict: Verdict) -> bool:
        """After a try: whether to try again, once its wait is over."""
        if not is_wait(verdict) or self.stopping():
            return False
        if self.max_hold is not None and time.monotonic() - self.started >= self.max_hold:
            return False
        self.stats.retries += 1
        log.info(
            "scope=%s key=%s: waiting %.2fs in hand (%s)",
            verdict.scope,
            verdict.key,
            verdict.retry_after,
            verdict.reason,
            extra={"scope": verdict.scope, "key": verdict.key},
        )
        await pause(max(verdict.retry_after, 0.05), self.stopping)  # never a busy loop
        return not self.stopping()


async def process_holding(
    process: Callable[[], Awaitable[Verdict]],
    *,
    stats: RunnerStats,
    stopping: Callable[[], bool],
    max_hold: float | None,
) -> Verdict:
    """``process()`` again, with the delivery in hand, for as long as its verdict is a wait
    (`Holding`). Returns the first verdict that is not a wait, or the last wait."""
    holding = Holding(stats, stopping, max_hold)
    verdict = await process()
    while await holding.again(verdict):
        verdict = await process()
    return verdict
