"""``@idempotent_consumer``: the transport-agnostic core of an idempotent message handler.

The decorated object turns a :class:`ConsumerMessage` into a :class:`Verdict`: what the
transport must do with the delivery (ack, retry later without acking, dead-letter with a reason,
or publish a reconciliation notice and then ack). The transports
(``consumer_idem.transports.kafka``, ``consumer_idem.transports.rabbit``,
``consumer_idem.faststream``) only carry verdicts out; this module never imports a broker client.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol, TypeVar, Unpack, overload

import asyncpg

from consumer_idem import tracing
from consumer_idem.backoff import Backoff
from consumer_idem.commit import (
    Rider,
    check_sql,
    commit,
    execute_and_commit,
    mark_sql,
    new_mark,
    rollback,
)
from consumer_idem.errors import (
    InvalidKey,
    InvalidPayload,
    KeyInFlight,
    PoisonMessage,
    StoreRejected,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.execution import (
    Attempt,
    outcome_of,
    run_transactional,
    run_two_phase,
)
from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_json
from consumer_idem.key_strategies import (
    describe,
)
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import encode_notice
from consumer_idem.options import ConsumerArgs, ConsumerOptions, Mode
from consumer_idem.outbox import backpressure, close_units, committed, open_batch, pending
from consumer_idem.stores.postgres.fast_path import Ahead
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.stores.results import encode_result
from consumer_idem.types import DecisionKind, Outcome, OutcomeKind, ResultKind

log = logging.getLogger("consumer_idem.consumer")

TransactionalHandler = Callable[[ConsumerMessage, asyncpg.Connection], Awaitable[Any]]
TwoPhaseHandler = Callable[[ConsumerMessage, Attempt], Awaitable[Any]]
BatchHandler = Callable[
    [list[ConsumerMessage], asyncpg.Connection], Awaitable[Sequence[Any] | None]
]


#: headers a dead-lettered copy carries (both transports)
DEAD_LETTER_REASON = "x-dead-letter-reason"
DEAD_LETTER_SCOPE = "x-dead-letter-scope"
DEAD_LETTER_KEY = "x-dead-letter-key"
DEAD_LETTER_ERROR = "x-dead-letter-error"


class Action(StrEnum):
    ACK = "ack"  #: the effect is durable (or never to happen): ack / commit the offset
    RETRY = "retry"  #: do not ack; deliver this message again after ``retry_after`` seconds
    DEAD_LETTER = "dead_letter"  #: publish to the dead-letter destination with ``reason``, then ack


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the transport must do with one delivery."""

    action: Action
    scope: str
    key: str | None = None
    outcome: Outcome | None = None
    reason: str | None = None
    retry_after: float = 0.0
    #: publish a reconciliation notice (durably) before acking: this delivery parked the key
    reconcile: bool = False
    #: a duplicate absorbed without running the handler
    duplicate: bool = False
    #: for a dead letter: the error text behind ``reason`` (goes into the dead-letter headers)
    error: str | None = None
    #: the span context of the delivery's span (``consumer_idem.tracing``): settling continues it
    trace_context: Any = field(default=None, compare=False, repr=False)

    @property
    def result(self) -> Any:
        return None if self.outcome is None else self.outcome.result


def reconcile_notice(
    verdict: Verdict,
    original: ConsumerMessage | None = None,
    source: str | None = None,
    properties: Mapping[str, Any] | None = None,
) -> bytes:
    """The reconciliation notice of a verdict about an ``unknown`` key (see ``notice.py``);
    with ``original`` and ``source``, carrying the original message whole (``properties``: its
    AMQP properties)."""
    assert verdict.key is not None
    return encode_notice(
        verdict.scope,
        verdict.key,
        notice_reason(verdict),
        source=source,
        original=original,
        properties=properties,
    )


def notice_reason(verdict: Verdict) -> str | None:
    """Why a key is ``unknown``, as its notice says: the record's last error, else the verdict's
    reason."""
    record = verdict.outcome.record if verdict.outcome is not None else None
    return (record.last_error if record else None) or verdict.reason


class CommitHook(Protocol):
    """A runner's own record of progress, committed with the deliveries it covers: the Kafka
    runner's consumed offset (``KafkaRunner(offsets_in_postgres=True)``). Transactional mode
    only; the consumer adds it to a transaction only while every delivery of the run up to
    that one is settled by the commit alone (executed, or a plain duplicate): never past one
    that still has a dead letter, a notice or an original to publish or keep."""

    def statement(self, upto: ConsumerMessage) -> str:
        """SQL (simple protocol, no parameters) recording that the run is settled up to and
        including ``upto``."""
        ...

    def committed(self, upto: ConsumerMessage) -> None:
        """The transaction carrying :meth:`statement` for ``upto`` has committed."""
        ...


def settled_by_commit(verdict: Verdict) -> bool:
    """Whether the transport only has to ack this verdict: nothing to publish or keep first
    (a dead letter, a reconciliation notice, the original of an ``unknown`` outcome)."""
    outcome = verdict.outcome
    return (
        verdict.action is Action.ACK
        and not verdict.reconcile
        and (outcome is None or outcome.kind is not OutcomeKind.UNKNOWN)
    )


class Processor(Protocol):
    """What a transport runner drives: an :class:`IdempotentConsumer`, or the reconciler."""

    store: PostgresStore
    scope: str
    batch: bool

    # plain defs returning awaitables: a wrapped (traced) coroutine function matches as well
    def process(self, message: ConsumerMessage) -> Awaitable[Verdict]: ...

    def process_batch(self, messages: Sequence[ConsumerMessage]) -> Awaitable[list[Verdict]]: ...


class IdempotentConsumer:
    """A handler made idempotent. Call :meth:`process` (or :meth:`process_batch`) per delivery;
    the transports do that for you."""

    def __init__(
        self,
        handler: Callable[..., Awaitable[Any]],
        *,
        store: PostgresStore,
        options: ConsumerOptions,
    ) -> None:
        scope = options.scope
        store.check(scope, "probe")  # a missing or bad scope fails at decoration time
        if not _is_async(handler):
            raise TypeError(
                f"{getattr(handler, '__name__', handler)!r} is not an async function: "
                "idempotent handlers must be `async def` (their work runs inside the event "
                "loop's transaction)"
            )
        self.handler = handler
        self.store = store
        self.options = options
        # unpacked once: read on every delivery
        self.scope = scope
        self.key = options.key
        self.mode = options.mode
        self.batch = options.batch
        self.payload = options.payload
        self.fingerprint_fields = (
            list(options.fingerprint_fields) if options.fingerprint_fields else None
        )
        self.local_writes = options.local_writes
        self.max_attempts = options.max_attempts
        self.lease = options.lease
        self.retention = options.retention
        self.on_invalid_key = options.on_invalid_key
        self.backoff_base, self.backoff_max = options.backoff
        self._retry_backoff = Backoff(self.backoff_base, self.backoff_max)
        self._store_failures = 0
        self._outage_since: float | None = None
        self.__name__ = getattr(handler, "__name__", "idempotent_consumer")
        self.__doc__ = handler.__doc__

    @property
    def metrics(self) -> Any:
        return self.store.metrics

    def __repr__(self) -> str:
        return f"<IdempotentConsumer {self.scope!r} key={describe(self.key)} mode={self.mode}>"

    # --- per message ---------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        """Before retrying a handler failure: exponential in its attempt count, jittered."""
        return self._retry_backoff.delay(attempt)

    def _outage_backoff(self) -> float:
        """Before retrying after the store was unavailable: as long as the outage has lasted
        (at least ``base``, at most the cap), half of it jittered. By duration, not by count:
        the many deliveries in flight when one connection blip hits must not push each other's
        waits to the cap."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
        ceiling = min(self.backoff_max, max(self.backoff_base, now - self._outage_since))
        return random.uniform(ceiling / 2, ceiling)

    def _store_up(self) -> None:
        self._store_failures = 0
        self._outage_since = None

    def prepare(self, message: ConsumerMessage) -> tuple[str, str] | Verdict:
        """Key and fingerprint of a message, or the dead-letter verdict explaining why not.
        Computed once per message object: a runner may call it ahead (the Kafka runner does,
        for fetched records, while the partition's previous transaction is in flight)."""
        memo = message._prepared
        if memo is not None and memo[0] is self:
            prepared: tuple[str, str] | Verdict = memo[1]
            return prepared
        prepared = self._prepare(message)
        object.__setattr__(message, "_prepared", (self, prepared))
        return prepared

    def _prepare(self, message: ConsumerMessage) -> tuple[str, str] | Verdict:
        try:
            raw_key = self.key(message)
            if raw_key is None:
                raise InvalidKey("missing_key", f"no idempotency key found ({describe(self.key)})")
            key = self.store.check_key(raw_key)  # the scope was checked at decoration
        except InvalidKey as exc:
            self.metrics.inc("invalid_key", self.scope)
            if self.on_invalid_key == "raise":
                raise
            log.debug("scope=%s: no valid key: %s", self.scope, exc, extra={"scope": self.scope})
            return Verdict(Action.DEAD_LETTER, self.scope, reason=f"invalid_key:{exc.reason}")
        if self.payload == "bytes":
            return key, fingerprint_bytes(message.body)
        try:
            value = message.json()
        except InvalidPayload as exc:
            log.debug(
                "scope=%s key=%s: not JSON: %s",
                self.scope,
                key,
                exc,
                extra={"scope": self.scope, "key": key},
            )
            return Verdict(Action.DEAD_LETTER, self.scope, key, reason="invalid_json")
        try:
            return key, fingerprint_json(value, self.fingerprint_fields)
        except ValueError:  # JSON that RFC 8785 cannot canonicalise: its exact bytes, then
            return key, fingerprint_bytes(message.body)

    def verdict(self, outcome: Outcome) -> Verdict:
        """Map an outcome to what the transport must do."""
        scope, key = outcome.scope, outcome.key
        kind = outcome.kind
        if kind is OutcomeKind.EXECUTED:
            return Verdict(Action.ACK, scope, key, outcome)
        if kind is OutcomeKind.REPLAYED:
            return Verdict(Action.ACK, scope, key, outcome, duplicate=True)
        if kind is OutcomeKind.IN_PROGRESS:
            wait = min(max(outcome.retry_after, self.backoff_base), self.backoff_max)
            return Verdict(
                Action.RETRY, scope, key, outcome, reason="in_progress", retry_after=wait
            )
        if kind is OutcomeKind.MISUSE:
            log.info(
                "scope=%s key=%s: key reused with another payload",
                scope,
                key,
                extra={"scope": scope, "key": key},
            )
            return Verdict(Action.DEAD_LETTER, scope, key, outcome, reason="key_misuse")
        if kind is OutcomeKind.FAILED_RETRYABLE and isinstance(outcome.error, _DETERMINISTIC):
            # running it again gives the same failure: dead-letter now, with the cause
            error = outcome.error
            log.info(
                "scope=%s key=%s: %s: %s",
                scope,
                key,
                "poison message" if isinstance(error, PoisonMessage) else error.reason,
                error,
                extra={"scope": scope, "key": key},
            )
            return Verdict(
                Action.DEAD_LETTER, scope, key, outcome, reason=error.reason, error=_text(error)
            )
        if kind is OutcomeKind.FAILED_RETRYABLE:
            if outcome.attempts >= self.max_attempts:
                log.info(
                    "scope=%s key=%s: giving up after %d attempts: %r",
                    scope,
                    key,
                    outcome.attempts,
                    outcome.error,
                    extra={"scope": scope, "key": key},
                )
                return Verdict(
                    Action.DEAD_LETTER,
                    scope,
                    key,
                    outcome,
                    reason="max_attempts_exceeded",
                    error=_text(outcome.error) if outcome.error else None,
                )
            return Verdict(
                Action.RETRY,
                scope,
                key,
                outcome,
                reason="failed_retryable",
                retry_after=self._backoff(outcome.attempts),
            )
        # UNKNOWN: the row is the truth and reconciliation owns it. Only the delivery that parked
        # it announces it; a later duplicate of a parked key is simply acked.
        if outcome.parked_now:
            return Verdict(Action.ACK, scope, key, outcome, reason="unknown", reconcile=True)
        return Verdict(Action.ACK, scope, key, outcome, reason="unknown", duplicate=True)

    def _store_rejected(self, exc: StoreRejected, key: str | None) -> Verdict:
        log.error(
            "scope=%s key=%s: the store rejected the delivery's data: %s",
            self.scope,
            key,
            exc,
            extra={"scope": self.scope, "key": key},
        )
        return Verdict(Action.DEAD_LETTER, self.scope, key, reason=exc.reason, error=_text(exc))

    def _store_down(self, exc: StoreUnavailable, key: str | None) -> Verdict:
        self._store_failures += 1
        log.log(
            logging.DEBUG if exc.said else logging.WARNING,  # said once for the episode
            "scope=%s key=%s: store unavailable, will retry: %s",
            self.scope,
            key,
            exc,
            extra={"scope": self.scope, "key": key},
        )
        return Verdict(
            Action.RETRY,
            self.scope,
            key,
            reason="store_unavailable",
            retry_after=self._outage_backoff(),
        )

    @tracing.traced_delivery
    async def process(
        self,
        message: ConsumerMessage,
        conn: asyncpg.Connection | None = None,
        rider: Rider | None = None,
    ) -> Verdict:
        """Run one delivery through the store (one transaction in transactional mode).
        ``conn``: a connection to use instead of a pooled one (transactional mode). ``rider``:
        a statement committed with the completion (transactional mode; see
        :func:`~consumer_idem.execution.run_transactional`)."""
        prepared = self.prepare(message)
        if isinstance(prepared, Verdict):
            return prepared
        return await self.execute(message, *prepared, conn=conn, rider=rider)

    @tracing.traced("handler")
    async def _run_handler(self, message: ConsumerMessage, arg: Any) -> Any:
        """The user's handler on one message: ``arg`` is the attempt (two-phase) or the
        connection (transactional; a batch handler gets a list of one)."""
        if self.mode == "two_phase" or not self.batch:
            return await self.handler(message, arg)
        results = await self.handler([message], arg)
        return results[0] if results else None

    @tracing.traced_delivery
    async def execute(
        self,
        message: ConsumerMessage,
        key: str,
        fingerprint: str,
        conn: asyncpg.Connection | None = None,
        rider: Rider | None = None,
    ) -> Verdict:
        """:meth:`process` after :meth:`prepare`: for a transport that needs the key first."""
        try:
            # the handler step, bound to this message (a partial: no closure to decorate per call)
            step = functools.partial(self._run_handler, message)
            if self.mode == "two_phase":
                outcome = await run_two_phase(
                    self.store,
                    self.scope,
                    key,
                    fingerprint,
                    step,
                    local_writes=self.local_writes,
                    lease=self.lease,
                    retention=self.retention,
                )
            else:
                outcome = await run_transactional(
                    self.store,
                    self.scope,
                    key,
                    fingerprint,
                    step,
                    retention=self.retention,
                    conn=conn,
                    rider=rider,
                )
        except StoreUnavailable as exc:
            return self._store_down(exc, key)
        except StoreRejected as exc:
            return self._store_rejected(exc, key)
        except KeyInFlight:
            # a lock_timeout of the session's (a handler's SET) ran out while another
            # transaction held the key's row: its work is in flight, as for a lease held
            return Verdict(
                Action.RETRY, self.scope, key, reason="in_progress", retry_after=self.backoff_base
            )
        self._store_up()
        if conn is None:  # holding no connection: wait while the outbox dispatch is behind
            await backpressure(self.store, self.scope)
        return self.verdict(outcome)

    # --- many messages -------------------------------------------------------------------------

    async def process_batch(
        self,
        messages: Sequence[ConsumerMessage],
        hook: CommitHook | None = None,
        *,
        alongside: Callable[[], Awaitable[object]] | None = None,
    ) -> list[Verdict]:
        """Verdicts for a run of messages from one ordered stream (a Kafka partition), in order.

        The list stops at the first RETRY: what follows must wait for it, to keep the order.
        In batch mode the whole run is claimed, handled and completed in one transaction; if any
        part of that fails, it falls back to one message per transaction. ``hook``: the
        runner's progress, committed with the transactions (see :class:`CommitHook`).
        ``alongside``: the transport's own preparation of the batch for its handler, run
        while the batch's claim is in flight in Postgres (its failure is ignored: it must be
        work the handler's call would otherwise do itself).
        """
        await backpressure(self.store, self.scope)  # the outbox dispatch is not far behind
        if not self.batch:
            return await self._one_by_one(messages, hook)
        try:
            return await self._as_one_transaction(messages, hook, alongside)
        except StoreUnavailable as exc:
            return [self._store_down(exc, None)]
        except Exception as exc:  # a member failed: find it by running them one by one
            log.info(
                "scope=%s: batch of %d failed (%r); falling back to one by one",
                self.scope,
                len(messages),
                exc,
                extra={"scope": self.scope},
            )
            # fresh copies: the rolled-back attempt may have changed the decoded bodies in place
            return await self._one_by_one([message.fresh() for message in messages], hook)

    async def _one_by_one(
        self, messages: Sequence[ConsumerMessage], hook: CommitHook | None = None
    ) -> list[Verdict]:
        verdicts: list[Verdict] = []
        if self.mode == "two_phase":  # no connection is held across external I/O
            for message in messages:
                verdicts.append(await self.process(message))
                if verdicts[-1].action is Action.RETRY:
                    break
            return verdicts
        fast_path = self.store.fast_path
        try:
            # one connection for the run: a pooled acquire/release per message costs a round trip
            async with self.store.connection() as conn:
                clean = hook is not None  # every delivery so far is settled by its commit
                try:
                    for i, message in enumerate(messages):
                        rider = _rider(hook, message) if clean else None
                        # the next message's BEGIN and claim ride with this one's COMMIT
                        ahead = self._ahead(messages[i + 1]) if i + 1 < len(messages) else None
                        if ahead is not None:
                            fast_path.ask_ahead(conn, ahead)
                        try:
                            verdicts.append(await self.process(message, conn, rider))
                        finally:
                            fast_path.forget_ahead(conn)
                        clean = clean and settled_by_commit(verdicts[-1])
                        # a dead connection fails every later message too: hand the rest back
                        if verdicts[-1].action is Action.RETRY or conn.is_closed():
                            break
                finally:
                    await fast_path.end_ahead(conn)
        except StoreUnavailable as exc:
            verdicts.append(self._store_down(exc, None))
        return verdicts

    def _ahead(self, message: ConsumerMessage) -> Ahead | None:
        """The claim of ``message`` to begin with the previous message's COMMIT, or None when it
        has no valid key (it is dead-lettered without a claim)."""
        try:
            prepared = self.prepare(message)
        except InvalidKey:  # on_invalid_key="raise": raised when its turn comes
            return None
        if isinstance(prepared, Verdict):
            return None
        return Ahead(self.scope, prepared[0], prepared[1], self.retention)

    @tracing.traced_batch
    async def _as_one_transaction(
        self,
        messages: Sequence[ConsumerMessage],
        hook: CommitHook | None = None,
        alongside: Callable[[], Awaitable[object]] | None = None,
    ) -> list[Verdict]:
        n = len(messages)
        verdicts: list[Verdict | None] = [None] * n
        first_seen: dict[str, tuple[int, str]] = {}
        repeats: list[tuple[int, int, str, str]] = []  # (index, first index, key, fingerprint)
        for i, message in enumerate(messages):
            prepared = self.prepare(message)
            if isinstance(prepared, Verdict):
                verdicts[i] = prepared
                continue
            key, fingerprint = prepared
            if key in first_seen:  # the same key twice in one batch: judge it after the first
                repeats.append((i, first_seen[key][0], key, fingerprint))
            else:
                first_seen[key] = (i, fingerprint)

        key_at = {i: key for key, (i, _) in first_seen.items()}
        run: list[int] = []
        tokens: dict[int, Any] = {}
        cut: int | None = None  # a member that must wait: nothing after it may run first
        upto: ConsumerMessage | None = None  # the last member the runner's hook covers
        async with self.store.connection() as conn:
            try:
                mark = new_mark()  # checked by the COMMIT: the handler must not end this
                begin = f"BEGIN; {mark_sql(mark)}"
                await conn.execute(begin)
                # sorted: concurrent batches (RabbitMQ's prefetch window holds several) take
                # the unique-index locks of shared keys in one order, so they never deadlock
                keys = sorted(first_seen)
                claim = self.store.fast_path.claim_many(
                    conn,
                    self.scope,
                    keys,
                    [first_seen[k][1] for k in keys],
                    self.retention,
                    restart=begin,
                )
                claimed = await (claim if alongside is None else _overlapped(claim, alongside))
                for key, (i, fingerprint) in first_seen.items():
                    if key in claimed:
                        run.append(i)
                        continue
                    decision = await self.store.reserve(
                        self.scope, key, fingerprint, retention=self.retention, conn=conn
                    )
                    if decision.kind is DecisionKind.EXECUTE:
                        run.append(i)
                        tokens[i] = decision.token
                        continue
                    decided = verdicts[i] = self.verdict(outcome_of(decision))
                    if decided.action is Action.RETRY and (cut is None or i < cut):
                        cut = i
                if cut is not None:
                    # Partition order: the members after a key held elsewhere must not commit
                    # before it. Undo these claims; run only the members before it.
                    await rollback(conn)
            except BaseException:
                await rollback(conn)
                raise
            if cut is None:
                # the runner's progress commits with the members settled by this commit alone
                settled = _settled_prefix(len(messages), verdicts, run, repeats, first_seen)
                upto = messages[settled - 1] if hook is not None and settled else None
                rider = hook.statement(upto) if hook is not None and upto is not None else ""
                try:
                    results = await self._run_claimed(
                        conn, messages, run, tokens, key_at, mark, rider
                    )
                except _EndedByHandler:
                    return await self._park_ended(conn, messages, run, key_at, first_seen)
        if cut is not None:
            head = await self._as_one_transaction(messages[:cut], hook) if cut else []
            waiting = verdicts[cut]
            assert waiting is not None
            return head if len(head) < cut else [*head, waiting]
        self._store_up()
        if hook is not None and upto is not None:
            hook.committed(upto)
        for i, result in zip(run, results, strict=True):
            key = key_at[i]
            outcome = Outcome(
                OutcomeKind.EXECUTED,
                self.scope,
                key,
                result=result,
                result_kind=ResultKind.SUCCESS,
                attempts=1,
            )
            verdicts[i] = Verdict(Action.ACK, self.scope, key, outcome)
        for i, first, key, fingerprint in repeats:
            original = verdicts[first]
            if fingerprint != first_seen[key][1]:
                self.metrics.inc("key_misuse", self.scope)
                verdicts[i] = Verdict(Action.DEAD_LETTER, self.scope, key, reason="key_misuse")
            elif original is not None:
                self.metrics.inc("replay", self.scope)
                verdicts[i] = Verdict(
                    original.action,
                    self.scope,
                    key,
                    original.outcome,
                    original.reason,
                    original.retry_after,
                    duplicate=True,
                )
        done: list[Verdict] = []
        for verdict in verdicts:
            assert verdict is not None
            done.append(verdict)
            if verdict.action is Action.RETRY:
                break
        return done

    async def _park_ended(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[ConsumerMessage],
        run: list[int],
        key_at: dict[int, str],
        first_seen: dict[str, tuple[int, str]],
    ) -> list[Verdict]:
        """The batch handler ended the transaction itself: whatever it wrote may be durable
        without the records that guard it, so no member of the run may run again. Each is
        parked as ``unknown`` (with a notice), unless its claim was committed by the handler's
        own COMMIT (then it is done). The other members are left to the next delivery."""
        log.error(
            "scope=%s: the batch handler ended the idempotency transaction itself (COMMIT or "
            "ROLLBACK): parking its %d members as unknown; never end it in a handler",
            self.scope,
            len(run),
            extra={"scope": self.scope},
        )
        parked: dict[int, Verdict] = {}
        for i in run:  # every member first: none of them may run again
            key = key_at[i]
            record = await self.store.fast_path.record_failure(
                self.scope,
                key,
                first_seen[key][1],
                "unknown",
                "the batch handler ended the idempotency transaction itself",
                retention=self.retention,
                conn=conn,
            )
            if record is not None:
                outcome = Outcome(
                    OutcomeKind.UNKNOWN, self.scope, key, record=record, parked_now=True
                )
                parked[i] = self.verdict(outcome)
        verdicts: list[Verdict] = []
        for i, message in enumerate(messages):  # the prefix that can be settled now
            if i in parked:
                verdicts.append(parked[i])
            elif i in run:  # committed by the handler's COMMIT, or held by someone else
                verdicts.append(await self.process(message.fresh(), conn))
            else:
                break  # not claimed here: its redelivery decides
            if verdicts[-1].action is Action.RETRY:
                break
        return verdicts

    async def _run_claimed(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[ConsumerMessage],
        run: list[int],
        tokens: dict[int, Any],
        key_at: dict[int, str],
        mark: str,
        rider: str = "",
    ) -> list[Any]:
        """Batch mode, inside the open transaction: the handler over the claimed members, their
        results, then a checked COMMIT (with the messages they published: each member is its
        own unit, ``outbox_for(conn, message)``). Rolls back and raises on any failure."""
        members = [messages[i] for i in run]
        units = open_batch(conn, self.scope, members, [key_at[i] for i in run], self.store)
        try:
            if not run:  # every member was decided by its record: nothing to hand the handler
                await (execute_and_commit(conn, rider) if rider else commit(conn))
                return []
            results = list(await self.handler(members, conn) or [])
            if not conn.is_closed() and not conn.is_in_transaction():
                raise _EndedByHandler  # COMMIT or ROLLBACK sent by the handler itself
            if results and len(results) != len(run):
                raise ValueError(f"batch handler returned {len(results)} results for {len(run)}")
            results += [None] * (len(run) - len(results))
            encoded = [encode_result(r) for r in results]
            store_keys: list[str] = []
            store_values: list[str] = []
            for i, result, enc in zip(run, results, encoded, strict=True):
                key = key_at[i]
                if i in tokens:
                    await self.store.complete(
                        self.scope, key, tokens[i], result, retention=self.retention, conn=conn
                    )
                elif enc is not None:
                    store_keys.append(key)
                    store_values.append(enc)
            await self.store.fast_path.store_results(conn, self.scope, store_keys, store_values)
            # still our transaction (the handler did not end and restart it), then the
            # outgoing messages and COMMIT, whose answer is checked: an aborted transaction
            # answers ROLLBACK, not done
            outgoing = pending(units)
            insert = await self.store.outbox.stage(conn, outgoing)  # a COPY for many
            check = check_sql(mark)
            await execute_and_commit(conn, "; ".join(s for s in (check, insert, rider) if s))
        except BaseException:
            await rollback(conn)
            raise
        finally:
            close_units(conn)
        committed(self.store, outgoing)  # sent now (or, failing that, by a relay)
        return results

    async def __call__(self, message: ConsumerMessage) -> Verdict:
        return await self.process(message)


_T = TypeVar("_T")


async def _overlapped(main: Awaitable[_T], side: Callable[[], Awaitable[object]]) -> _T:
    """``main``'s answer, with ``side`` run while ``main`` waits for Postgres (a batch's claim
    takes milliseconds of the server's time, in which this process would sit idle). ``side``
    failing is only logged; ``main`` never outlives this call."""
    task = asyncio.ensure_future(main)
    try:
        await asyncio.sleep(0)  # main's query goes out before side takes the loop
        try:
            await side()
        except Exception:
            log.debug("work alongside a claim failed (the handler's call redoes it)", exc_info=True)
        return await task
    finally:
        if not task.done():  # cancelled while side ran: the connection must be free after
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _rider(hook: CommitHook | None, message: ConsumerMessage) -> Rider | None:
    if hook is None:
        return None
    return Rider(hook.statement(message), lambda: hook.committed(message))


def _settled_prefix(
    n: int,
    verdicts: Sequence[Verdict | None],
    run: Sequence[int],
    repeats: Sequence[tuple[int, int, str, str]],
    first_seen: Mapping[str, tuple[int, str]],
) -> int:
    """Batch mode, before the COMMIT: how many leading members that COMMIT settles on its own
    (run members, plain duplicates), stopping at the first with something left to publish or
    keep (a dead letter, a notice, an ``unknown`` outcome) or to wait for."""
    running = set(run)
    repeat_of = {i: (first, fp == first_seen[key][1]) for i, first, key, fp in repeats}

    def settled(i: int) -> bool:
        if i in running:
            return True
        if i in repeat_of:
            first, same = repeat_of[i]
            return same and settled(first)
        verdict = verdicts[i]
        return verdict is not None and settled_by_commit(verdict)

    for i in range(n):
        if not settled(i):
            return i
    return n


class _EndedByHandler(Exception):
    """The batch handler sent COMMIT or ROLLBACK on the batch's connection itself."""


#: failures that running the handler again would only repeat: dead-lettered at once
_DETERMINISTIC = (PoisonMessage, UnstorableResult)


def _text(exc: BaseException) -> str:
    """An error as the dead-letter headers carry it."""
    return f"{type(exc).__name__}: {exc}"[:1000]


def _is_async(handler: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


@overload
def idempotent_consumer(
    store: PostgresStore,
    *,
    scope: str,
    mode: Literal["transactional"] = "transactional",
    batch: Literal[False] = False,
    **options: Unpack[ConsumerArgs],
) -> Callable[[TransactionalHandler], IdempotentConsumer]: ...


@overload
def idempotent_consumer(
    store: PostgresStore,
    *,
    scope: str,
    mode: Literal["transactional"] = "transactional",
    batch: Literal[True],
    **options: Unpack[ConsumerArgs],
) -> Callable[[BatchHandler], IdempotentConsumer]: ...


@overload
def idempotent_consumer(
    store: PostgresStore,
    *,
    scope: str,
    mode: Literal["two_phase"],
    batch: Literal[False] = False,
    **options: Unpack[ConsumerArgs],
) -> Callable[[TwoPhaseHandler], IdempotentConsumer]: ...


def idempotent_consumer(
    store: PostgresStore,
    *,
    scope: str,
    mode: Mode = "transactional",
    batch: bool = False,
    **options: Unpack[ConsumerArgs],
) -> Callable[[Any], IdempotentConsumer]:
    """Make a message handler idempotent. The handler's signature follows the mode:

    * ``mode="transactional"`` (default): ``async def handler(message, conn)`` does its writes on
      ``conn``; they commit in the same transaction as the idempotency record.
    * ``mode="two_phase"``: ``async def handler(message, attempt)`` does external I/O under a
      lease; raise :class:`Retryable`, :class:`Ambiguous` or :class:`DomainError` to classify
      failures. ``local_writes(conn, result)`` commits local rows with the completion.
    * ``batch=True`` (transactional): ``async def handler(messages, conn) -> results | None``
      handles a whole fetched run in one transaction (use ``executemany``).

    The other keyword arguments are the fields of :class:`ConsumerOptions` (key strategy,
    payload, fingerprint fields, attempts, lease, retention, backoff), checked here: a bad
    combination fails at decoration time, not on the first message.
    """
    settings = ConsumerOptions(scope=scope, mode=mode, batch=batch, **options)

    def wrap(handler: Callable[..., Awaitable[Any]]) -> IdempotentConsumer:
        return IdempotentConsumer(handler, store=store, options=settings)

    return wrap
