"""One request with an ``Idempotency-Key``, from its claim to its response: the unit of work
of the middleware. It claims its key (transactional or two-phase), runs the endpoint or
answers from the record, waits for a first request in flight when its route says so, and
answers a store that failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from consumer_idem import tracing
from consumer_idem.claim import TransactionalClaim, TwoPhaseClaim, is_lock_timeout, waiters_for
from consumer_idem.commit import rollback
from consumer_idem.completion_waiters import notify_settled
from consumer_idem.downstream import downstream_key_for
from consumer_idem.errors import (
    CommitRolledBack,
    KeyInFlight,
    LeaseLost,
    Retryable,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
    StreamCutShort,
)
from consumer_idem.http import responses
from consumer_idem.http.asgi import Receive, Scope, Send
from consumer_idem.http.began import release_unbegun
from consumer_idem.http.capture import Captured, EndpointFailed, StreamIncomplete
from consumer_idem.http.context import IdempotencyContext
from consumer_idem.http.fail_open import Held, may_bypass
from consumer_idem.http.hooks import RequestHook, RequestOutcome, call_request_hook
from consumer_idem.http.reading import replay_body
from consumer_idem.http.responses import Started, send_response
from consumer_idem.http.routing import Mode
from consumer_idem.types import Decision, DecisionKind, OutcomeKind

if TYPE_CHECKING:
    from consumer_idem.http.middleware import IdempotencyMiddleware

log = logging.getLogger("consumer_idem.http")

#: how long a re-check of a waiting request may wait on a row lock: it must not hold the
#: connection while the first request runs (it is woken when that one commits)
RECHECK_LOCK_TIMEOUT_MS = 20

#: store failures answered as such (fail-closed, or fail-open where that is safe)
_STORE_FAILED = (StoreUnavailable, SchemaMissing, StoreRejected, CommitRolledBack)

#: one attempt to claim and run: ``None`` once answered, else seconds to look again after
Attempt = Callable[[bool], Awaitable[float | None]]


@dataclass
class KeyedRequest:
    """One request through the middleware, while it is handled."""

    middleware: IdempotencyMiddleware
    scope: Scope
    #: the body, read to fingerprint it; and the server's ``receive`` after it
    body: bytes
    server_receive: Receive
    server_send: Send
    method: str
    route: str
    record_scope: str
    key: str
    fingerprint: str
    mode: Mode
    fail_open: bool
    wait: float
    started_at: float
    #: the endpoint has been called: from here on, fail-open may not skip protection
    ran: bool = False
    #: the store said another request holds this key: skipping protection could run it twice
    held_elsewhere: bool = False
    #: a store statement returned a decision for this request: the store is not down
    consulted: bool = False
    #: this request holds its key in the in-process registry (claimed, or bypassed)
    holding: bool = False
    #: the endpoint ran and its outcome is recorded (or nothing of it can have happened)
    settled: bool = False
    #: the route tells when its endpoint begins: an answer from before then is not recorded
    watched: bool = False
    #: the route's hooks (`consumer_idem.http.hooks`)
    on_execute: RequestHook | None = None
    on_replay: RequestHook | None = None

    def __post_init__(self) -> None:
        # the app reads the body again, then the real receive
        self.receive = replay_body(self.body, self.server_receive)
        self.send = Started(self.server_send)
        self.held: Held = (self.record_scope, self.key)

    # --- the request from start to end --------------------------------------------------------

    async def handle(self) -> None:
        with tracing.request(self.scope, self.method, self.route, self.record_scope, self.key):
            try:
                await self._attempts()
            except _STORE_FAILED as exc:
                await self._store_failed(exc)
            finally:
                self._release()
                if self.ran and not self.settled:
                    # its retry must never be let through by fail-open while the store is away
                    self.middleware.held_keys.remember_unsettled(self.held)

    async def _attempts(self) -> None:
        attempt = self._two_phase if self.mode == "two_phase" else self._transactional
        retry_after = await attempt(False)
        self.held_elsewhere = retry_after is not None
        if retry_after is not None and self.wait > 0:
            retry_after = await self._wait(attempt)
        if retry_after is not None:
            self._count("in_progress")
            await send_response(self.send, responses.in_progress(retry_after))

    async def _wait(self, attempt: Attempt) -> float | None:
        """The key is in flight: wait until its owner settles it, then claim again (usually a
        replay), until ``self.wait`` runs out. Nothing is held meanwhile: no connection, no
        transaction. The owner's COMMIT notifies; a re-check now and then covers a notice
        that never comes (the owner's process died: its transaction rolled back)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait - (time.monotonic() - self.started_at)
        waiters = waiters_for(self.middleware.store)
        poll = min(0.25, waiters.poll_cap / 4)
        async with waiters.watch(self.record_scope, self.key) as woken:
            while True:
                # listening already: a settlement from here on wakes us, none slips through
                retry_after = await attempt(True)
                remaining = deadline - loop.time()
                if retry_after is None or remaining <= 0:
                    return retry_after
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(remaining, poll))
                woken.clear()
                poll = min(poll * 2, waiters.poll_cap)

    # --- transactional -------------------------------------------------------------------------

    async def _transactional(self, recheck: bool) -> float | None:
        """One attempt: ``None`` once the request is answered, else the seconds after which
        the request in flight may be done (nothing was sent)."""
        if self._held_here(bypassed=True):
            # this process runs the key unprotected: no record shows it. (A protected holder
            # is in the store: its row lock or lease answers, and a duplicate may replay it)
            return 1.0
        store = self.middleware.store
        lock_timeout = self.middleware.lock_timeout_ms
        if recheck:
            lock_timeout = min(lock_timeout, RECHECK_LOCK_TIMEOUT_MS)
        try:
            async with (
                store.connection() as conn,
                TransactionalClaim(
                    store,
                    conn,
                    self.record_scope,
                    self.key,
                    self.fingerprint,
                    lock_timeout_ms=lock_timeout,
                    domain_errors=False,  # the endpoint's 4xx responses are its domain errors
                    notify=self.wait > 0,
                ) as claim,
            ):
                self.consulted = True
                if claim.decision is not None:
                    return await self._decided(claim.decision)
                self._hold()
                await self._run_transactional(claim, conn)
                return None
        except KeyInFlight:
            return 1.0

    async def _run_transactional(self, claim: TransactionalClaim, conn: asyncpg.Connection) -> None:
        context = IdempotencyContext(self.record_scope, self.key, "transactional", connection=conn)
        try:
            captured = await self._run_endpoint(context)
        except Exception as exc:  # (a cancellation is rolled back by the claim, not recorded)
            # a stream that died mid-way included: rolled back, never a stored success
            self._failed(await claim.fail(exc, "exception in endpoint"))
            raise
        if context.began is False:  # the framework answered: nothing ran, nothing is kept
            await rollback(conn)
            await self._not_begun(captured)
            return
        if captured.incomplete:  # rolled back; the client is gone, or gets a broken response
            self._failed(await claim.fail(StreamIncomplete(), "stream incomplete"))
            self._count("failed")
            return
        if captured.status >= 500:  # nothing of it is committed: it may run again
            failed = await claim.fail(EndpointFailed(captured.status), f"http {captured.status}")
            self._failed(failed)
            self._count("failed")
        elif not await self._committed(claim, captured):
            return
        await self._respond(captured)

    async def _committed(self, claim: TransactionalClaim, captured: Captured) -> bool:
        """Complete the claim with the endpoint's response: did it commit? When it did not,
        the client was told (or its stream is cut short)."""
        outcome = await claim.complete(response=captured.stored(self.middleware.stored_headers))
        # REPLAYED: the endpoint's own COMMIT took the claim row with its changes; they
        # exist, and the endpoint's answer describes them
        if outcome.kind in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED):
            self._settle()
            self._count("executed")
            self._hook(False, captured.status, captured.headers)
            return True
        # Postgres did not commit (the endpoint swallowed a database error, say): the
        # endpoint's answer describes changes that do not exist; it must not be sent.
        # Or the endpoint ended the transaction itself: parked, its outcome unknown
        unknown = outcome.kind is OutcomeKind.UNKNOWN
        if not unknown:  # rolled back: nothing of it exists, it may run again
            self._settle()
        self._count("unknown" if unknown else "failed")
        if captured.streaming:
            raise StreamCutShort("the streamed response's transaction did not commit")
        await send_response(
            self.send, responses.NOT_RECORDED if unknown else responses.NOT_COMMITTED
        )
        return False

    def _failed(self, outcome: Any) -> None:
        """A transactional attempt rolled back: settled, unless its outcome is unknown (the
        endpoint ended the transaction itself)."""
        if getattr(outcome, "kind", None) is not OutcomeKind.UNKNOWN:
            self._settle()

    # --- two-phase -----------------------------------------------------------------------------

    async def _two_phase(self, recheck: bool) -> float | None:
        """One attempt, as `_transactional`."""
        if self._held_here(bypassed=True):
            return 1.0  # run unprotected by this process, in no record
        claim = TwoPhaseClaim(
            self.middleware.store,
            self.record_scope,
            self.key,
            self.fingerprint,
            lease=self.middleware.lease,
            notify=self.wait > 0,
        )
        try:
            decision = await claim.reserve()
        except StoreUnavailable as exc:
            if is_lock_timeout(exc):  # a concurrent owner holds the row: in flight
                return 1.0
            raise
        self.consulted = True
        if decision.kind is not DecisionKind.EXECUTE:
            return await self._decided(decision)
        assert claim.attempt is not None
        self._hold()
        context = IdempotencyContext(
            self.record_scope,
            self.key,
            "two_phase",
            downstream_key=claim.attempt.downstream_key,
        )
        await self._run_two_phase(claim, context)
        return None

    async def _run_two_phase(self, claim: TwoPhaseClaim, context: IdempotencyContext) -> None:
        try:
            captured = await self._run_endpoint(context)
        except Retryable as exc:
            await claim.fail_retryable(exc)
            await self._not_processed(exc)
            return
        except BaseException as exc:  # the external call may have happened
            # a stream that died mid-way included: parked, never a stored success
            await claim.park(exc)
            raise
        if context.began is False:  # the framework answered: nothing ran, nothing is kept
            await release_unbegun(claim)
            await self._not_begun(captured)
            return
        if captured.incomplete:  # what the stream was doing when it stopped is unknown
            await claim.park(StreamIncomplete())
            self._count("unknown")
            return
        if captured.status >= 500:  # it may have charged: parked, reconciled, never re-run
            await claim.park(EndpointFailed(captured.status))
            self._count("unknown")
        elif not await self._recorded(claim, captured, context):
            return
        await self._respond(captured)

    async def _not_processed(self, exc: Retryable) -> None:
        """The endpoint failed before its effect (``Retryable``): it may run again."""
        self._settle()
        log.info(
            "endpoint failed before its effect (retryable): %s",
            exc,
            extra={"scope": self.record_scope, "key": self.key},
        )
        self._count("failed")
        if self.send.started:  # a stream that gave up: cut it short
            raise exc
        await send_response(self.send, responses.RETRYABLE)

    async def _recorded(
        self, claim: TwoPhaseClaim, captured: Captured, context: IdempotencyContext
    ) -> bool:
        """Complete the claim with the endpoint's response and its local writes: is the
        effect's answer to be sent? When not, the client was told (or its stream cut short)."""
        outcome = await claim.complete(
            response=captured.stored(self.middleware.stored_headers), writes=context.writes
        )
        if outcome.kind is not OutcomeKind.EXECUTED and not isinstance(outcome.error, LeaseLost):
            # the effect happened, its record could not be written: parked as unknown
            self._count("unknown")
            if captured.streaming:
                raise StreamCutShort("the streamed response's outcome was not recorded")
            await send_response(self.send, responses.NOT_RECORDED)
            return False
        # executed; or fenced (the lease ran out, the record was parked): the effect
        # happened all the same, and the endpoint's answer says so
        if outcome.kind is OutcomeKind.EXECUTED:
            self._settle()
        self._count("executed")
        self._hook(False, captured.status, captured.headers)
        return True

    # --- running the endpoint, answering -------------------------------------------------------

    async def _run_endpoint(self, context: IdempotencyContext) -> Captured:
        self.ran = True
        return await self.middleware._run_app(self, context)

    async def _not_begun(self, captured: Captured) -> None:
        """The framework answered before the endpoint began (a 422 of its validation, a
        dependency that refused): passed through, and the key is free for a corrected
        retry; a duplicate waiting for it is woken."""
        self._settle()
        if self.wait > 0:
            await notify_settled(self.middleware.store, self.record_scope, self.key)
        self._count("not_begun")
        await self._respond(captured)

    async def _respond(self, captured: Captured) -> None:
        self._release()  # settled: a duplicate meets the record from here on
        await captured.respond()

    async def _decided(self, decision: Decision) -> float | None:
        """Someone else's key: answer, or (in flight) say when to look again."""
        self.consulted = True
        if decision.kind is DecisionKind.IN_PROGRESS:
            return decision.retry_after
        if decision.kind is DecisionKind.REPLAY:
            self._count("replayed")
            record = decision.record
            status, headers, body = responses.replayed(record.response, record.result_json)
            self._hook(True, status, headers)
            await self.send.response(status, headers, body)
        elif decision.kind is DecisionKind.MISUSE:
            self._count("key_misuse")
            await send_response(self.send, responses.KEY_REUSED)
        else:  # UNKNOWN
            self._count("unknown")
            await send_response(self.send, responses.OUTCOME_BEING_RECONCILED)
        return None

    # --- the store failed ----------------------------------------------------------------------

    async def _store_failed(self, exc: Exception) -> None:
        if self.send.started:
            raise exc
        if not self.ran and is_lock_timeout(exc):
            self._count("in_progress")
            await send_response(self.send, responses.in_progress(1))
            return
        # the cause goes to the log, never to the client; once per episode where the store
        # said it already (a server that cannot take writes: see StoreUnavailable.said)
        said = isinstance(exc, StoreUnavailable) and exc.said
        log.log(
            logging.DEBUG if said else logging.WARNING,
            "idempotency store failed (%s): %s",
            "before the endpoint ran" if not self.ran else "after the endpoint ran",
            exc,
            extra={"scope": self.record_scope, "key": self.key},
        )
        if self.ran:
            # the endpoint ran: "not processed" would be a lie, and running it again (fail
            # open or not) could apply it twice. The retry meets the record: a replay, an
            # in-flight or unknown answer, or (transactional, nothing committed) a first run
            self._count("store_unavailable")
            await send_response(self.send, responses.OUTCOME_UNCONFIRMED)
            return
        if self.fail_open and may_bypass(
            exc, ran=self.ran, held_elsewhere=self.held_elsewhere, consulted=self.consulted
        ):
            await self._bypass()
            return
        self._count("store_unavailable")
        await send_response(self.send, responses.STORE_UNAVAILABLE)

    async def _bypass(self) -> None:
        """Fail-open: run the endpoint unprotected, in no record, unless this process holds
        the key or ran it without a settled outcome."""
        held_keys = self.middleware.held_keys
        if self._held_here(bypassed=False):
            # this process holds the key right now: a second run is a duplicate
            self._count("in_progress")
            await send_response(self.send, responses.in_progress(1))
            return
        if held_keys.unsettled(self.held):
            # it ran here and its outcome was never recorded: never run it again
            self._count("unknown")
            await send_response(self.send, responses.NOT_RECORDED)
            return
        self._count("bypassed")
        self._hold(bypassed=True)
        self.ran = True  # never recorded: a retry is never bypassed again
        context = IdempotencyContext(
            self.record_scope,
            self.key,
            self.mode,
            connection=None,
            downstream_key=downstream_key_for(self.record_scope, self.key)
            if self.mode == "two_phase"
            else None,
        )
        scope = dict(self.scope)
        scope["state"] = {**(self.scope.get("state") or {}), "idempotency": context}
        await self.middleware.app(
            scope,
            replay_body(self.body, self.server_receive),
            responses.with_header(self.server_send, b"idempotency-status", b"bypassed"),
        )

    # --- this process's registries -------------------------------------------------------------

    def _hold(self, *, bypassed: bool = False) -> None:
        """From its claim until its outcome is settled (or while it runs bypassed), this
        process holds (scope, key)."""
        if self.holding:
            return
        self.holding = True
        self.middleware.held_keys.hold(self.held, bypassed=bypassed)

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self.middleware.held_keys.release(self.held)

    def _held_here(self, *, bypassed: bool) -> bool:
        """Does another request of this process hold the key (``bypassed``: run it
        unprotected)?"""
        if self.holding:
            return False
        held_keys = self.middleware.held_keys
        return held_keys.bypassed(self.held) if bypassed else held_keys.running(self.held)

    def _settle(self) -> None:
        self.settled = True
        self.middleware.held_keys.settled(self.held)

    def _hook(self, replayed: bool, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """``on_replay`` / ``on_execute`` on this request; it may change ``headers`` in place."""
        hook = self.on_replay if replayed else self.on_execute
        if hook is not None:
            call_request_hook(
                hook,
                RequestOutcome(
                    self.record_scope,
                    self.key,
                    self.method,
                    self.route,
                    replayed,
                    status,
                    headers,
                    self.scope,
                ),
            )

    def _count(self, outcome: str) -> None:
        self.middleware.count(self.method, self.route, outcome)
