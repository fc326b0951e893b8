"""``@idempotent_consumer``: the transport-agnostic core of an idempotent message handler.

The decorated object turns a [`ConsumerMessage`][consumer_idem.ConsumerMessage] into a
[`Verdict`][consumer_idem.consumer.Verdict]: what the
transport must do with the delivery (ack, retry later without acking, dead-letter with a reason,
or publish a reconciliation notice and then ack). The transports
(``consumer_idem.transports.kafka``, ``consumer_idem.transports.rabbit``,
``consumer_idem.faststream``) only carry verdicts out; this module never imports a broker client.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Unpack, overload

import asyncpg

from consumer_idem import handler_runs, tracing
from consumer_idem.backoff import Backoff
from consumer_idem.batch import BatchUnit
from consumer_idem.commit import Rider
from consumer_idem.errors import (
    InvalidKey,
    InvalidPayload,
    KeyInFlight,
    PoisonMessage,
    StoredResultMismatch,
    StoreRejected,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.execution import Attempt, run_transactional, run_two_phase
from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_json
from consumer_idem.key_strategies import describe
from consumer_idem.message import ConsumerMessage
from consumer_idem.options import ConsumerArgs, ConsumerOptions, Mode
from consumer_idem.outbox import backpressure
from consumer_idem.result_types import resolve_result_type
from consumer_idem.stores.postgres.fast_path import Ahead
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Outcome, OutcomeKind

# what a transport does with a delivery: defined in ``verdict``, importable from here
from consumer_idem.verdict import DEAD_LETTER_ERROR as DEAD_LETTER_ERROR
from consumer_idem.verdict import DEAD_LETTER_KEY as DEAD_LETTER_KEY
from consumer_idem.verdict import DEAD_LETTER_REASON as DEAD_LETTER_REASON
from consumer_idem.verdict import DEAD_LETTER_SCOPE as DEAD_LETTER_SCOPE
from consumer_idem.verdict import Action as Action
from consumer_idem.verdict import CommitHook as CommitHook
from consumer_idem.verdict import Processor as Processor
from consumer_idem.verdict import Verdict as Verdict
from consumer_idem.verdict import error_text
from consumer_idem.verdict import notice_reason as notice_reason
from consumer_idem.verdict import reconcile_notice as reconcile_notice
from consumer_idem.verdict import settled_by_commit as settled_by_commit
from consumer_idem.verdict_hooks import call_hook, call_settled

log = logging.getLogger("consumer_idem.consumer")

TransactionalHandler = Callable[[ConsumerMessage, asyncpg.Connection], Awaitable[Any]]
TwoPhaseHandler = Callable[[ConsumerMessage, Attempt], Awaitable[Any]]
BatchHandler = Callable[
    [list[ConsumerMessage], asyncpg.Connection], Awaitable[Sequence[Any] | None]
]


class IdempotentConsumer:
    """A handler made idempotent. Call `process` (or `process_batch`) per delivery;
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
        # resolved once here: a replay reads its result back through it (result_types.py)
        self.result_type = resolve_result_type(handler, options.result_type, batch=options.batch)
        self.on_execute = options.on_execute
        self.on_replay = options.on_replay
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

    def store_up(self) -> None:
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

    def verdict(self, outcome: Outcome, hooks: bool = True) -> Verdict:
        """Map an outcome to what the transport must do (a replay's result read back as the
        handler's result type). ``hooks``: call ``on_execute`` / ``on_replay`` now (batch mode
        calls them itself, once its transaction has committed: `settled`)."""
        scope, key = outcome.scope, outcome.key
        kind = outcome.kind
        if kind is OutcomeKind.EXECUTED:
            verdict = Verdict(Action.ACK, scope, key, outcome)
            if hooks and self.on_execute is not None:
                call_hook(self.on_execute, verdict)
            return verdict
        if kind is OutcomeKind.REPLAYED:
            return self._replayed(outcome, hooks)
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
                Action.DEAD_LETTER,
                scope,
                key,
                outcome,
                reason=error.reason,
                error=error_text(error),
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
                    error=error_text(outcome.error) if outcome.error else None,
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

    def settled(self, verdicts: Sequence[Verdict]) -> None:
        """``on_execute`` / ``on_replay`` for verdicts whose fate is settled: an acked
        execution, or a duplicate acked with the stored (or the batch's first) result."""
        call_settled(self.on_execute, self.on_replay, verdicts)

    def _replayed(self, outcome: Outcome, hooks: bool) -> Verdict:
        scope, key = outcome.scope, outcome.key
        try:
            outcome = self.result_type.read(outcome)
        except StoredResultMismatch as exc:  # the type changed since: the same on every try
            log.error("%s", exc, extra={"scope": scope, "key": key})
            return Verdict(
                Action.DEAD_LETTER, scope, key, outcome, reason=exc.reason, error=error_text(exc)
            )
        verdict = Verdict(Action.ACK, scope, key, outcome, duplicate=True)
        if hooks and self.on_replay is not None:
            call_hook(self.on_replay, verdict)
        return verdict

    def _store_rejected(self, exc: StoreRejected, key: str | None) -> Verdict:
        log.error(
            "scope=%s key=%s: the store rejected the delivery's data: %s",
            self.scope,
            key,
            exc,
            extra={"scope": self.scope, "key": key},
        )
        return Verdict(
            Action.DEAD_LETTER, self.scope, key, reason=exc.reason, error=error_text(exc)
        )

    def store_down(self, exc: StoreUnavailable, key: str | None) -> Verdict:
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

    async def process(
        self,
        message: ConsumerMessage,
        conn: asyncpg.Connection | None = None,
        rider: Rider | None = None,
    ) -> Verdict:
        """Run one delivery through the store (one transaction in transactional mode).
        ``conn``: a connection to use instead of a pooled one (transactional mode). ``rider``:
        a statement committed with the completion (transactional mode; see
        [`run_transactional`][consumer_idem.execution.run_transactional])."""
        with tracing.delivery(self, message) as span:
            prepared = self.prepare(message)
            if isinstance(prepared, Verdict):
                return span.done(prepared)
            return span.done(await self._execute(message, *prepared, conn, rider))

    async def _run_handler(self, message: ConsumerMessage, arg: Any) -> Any:
        """The user's handler on one message: ``arg`` is the attempt (two-phase) or the
        connection (transactional; a batch handler gets a list of one)."""
        with tracing.step("handler"):
            handler_runs.note_started()
            if self.mode == "two_phase" or not self.batch:
                return await self.handler(message, arg)
            results = await self.handler([message], arg)
            return results[0] if results else None

    async def execute(
        self,
        message: ConsumerMessage,
        key: str,
        fingerprint: str,
        conn: asyncpg.Connection | None = None,
        rider: Rider | None = None,
    ) -> Verdict:
        """`process` after `prepare`: for a transport that needs the key first."""
        with tracing.delivery(self, message) as span:
            return span.done(await self._execute(message, key, fingerprint, conn, rider))

    async def _execute(
        self,
        message: ConsumerMessage,
        key: str,
        fingerprint: str,
        conn: asyncpg.Connection | None,
        rider: Rider | None,
    ) -> Verdict:
        try:
            # the handler step, bound to this message (a partial: no closure per call)
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
            return self.store_down(exc, key)
        except StoreRejected as exc:
            return self._store_rejected(exc, key)
        except KeyInFlight:
            # a lock_timeout of the session's (a handler's SET) ran out while another
            # transaction held the key's row: its work is in flight, as for a lease held
            return Verdict(
                Action.RETRY, self.scope, key, reason="in_progress", retry_after=self.backoff_base
            )
        self.store_up()
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
        runner's progress, committed with the transactions (see `CommitHook`).
        ``alongside``: the transport's own preparation of the batch for its handler, run
        while the batch's claim is in flight in Postgres (its failure is ignored: it must be
        work the handler's call would otherwise do itself).
        """
        await backpressure(self.store, self.scope)  # the outbox dispatch is not far behind
        if not self.batch:
            return await self._one_by_one(messages, hook)
        try:
            with tracing.batch(self.scope, messages) as span:
                return span.done_all(await BatchUnit(self, messages, hook, alongside)())
        except StoreUnavailable as exc:
            return [self.store_down(exc, None)]
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
        store = self.store
        try:
            # one connection for the run: a pooled acquire/release per message costs a round
            # trip; the next message's BEGIN and claim ride with this one's COMMIT
            async with store.connection() as conn, store.fast_path.run_on(conn) as run:
                clean = hook is not None  # every delivery so far is settled by its commit
                for i, message in enumerate(messages):
                    rider = _rider(hook, message) if clean else None
                    ahead = self._ahead(messages[i + 1]) if i + 1 < len(messages) else None
                    if ahead is not None:
                        run.ask(ahead)
                    try:
                        verdicts.append(await self.process(message, conn, rider))
                    finally:
                        run.forget()
                    clean = clean and settled_by_commit(verdicts[-1])
                    # a dead connection fails every later message too: hand the rest back
                    if verdicts[-1].action is Action.RETRY or conn.is_closed():
                        break
        except StoreUnavailable as exc:
            verdicts.append(self.store_down(exc, None))
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

    async def __call__(self, message: ConsumerMessage) -> Verdict:
        return await self.process(message)


def _rider(hook: CommitHook | None, message: ConsumerMessage) -> Rider | None:
    if hook is None:
        return None
    return Rider(hook.statement(message), lambda: hook.committed(message))


#: failures that running the handler again would only repeat: dead-lettered at once
_DETERMINISTIC = (PoisonMessage, UnstorableResult)


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
      lease; raise [`Retryable`][consumer_idem.Retryable], [`Ambiguous`][consumer_idem.Ambiguous] or
      [`DomainError`][consumer_idem.DomainError] to classify
      failures. ``local_writes(conn, result)`` commits local rows with the completion.
    * ``batch=True`` (transactional): ``async def handler(messages, conn) -> results | None``
      handles a whole fetched run in one transaction (use ``executemany``).

    The other keyword arguments are the fields of [`ConsumerOptions`][consumer_idem.ConsumerOptions]
    (key strategy,
    payload, fingerprint fields, attempts, lease, retention, backoff), checked here: a bad
    combination fails at decoration time, not on the first message.
    """
    settings = ConsumerOptions(scope=scope, mode=mode, batch=batch, **options)

    def wrap(handler: Callable[..., Awaitable[Any]]) -> IdempotentConsumer:
        return IdempotentConsumer(handler, store=store, options=settings)

    return wrap
