"""Delivery budgets that count the attempts of a key's own work (``max_deliveries``).

A broker's redelivery counter (``x-delivery-count``, ``redelivered``) counts every return of
a message. A consumer killed by one poison message returns every unacked delivery of its
channel, and the broker counts them all: its window-mates would be dead-lettered for the
poison's crashes without ever having run. An effect that committed but whose ack kept being
lost would be dead-lettered too, and a later replay of the dead letter would run it again.
So the broker's counter is only a hint here:

* A delivery the broker has not delivered before runs as usual, without a write of its own;
  if its handler fails, that attempt is counted then.
* A delivery it has delivered before (it may be what killed the last consumer) is a suspect.
  Suspects run alone: no other handler of the process runs beside one, first deliveries
  included (`run_gate`), and each counts one attempt of its key
  in Postgres (`DeliveryAttempts`), committed on
  its own right before the claim and the handler: a crash in the handler is counted against the
  key that was running alone, never against the deliveries waiting their turn, nor for a fresh
  poison that would have run beside it. (A first delivery that kills the process is not
  counted: a poison runs at most ``max_deliveries + 1`` times.)
* With ``max_deliveries`` attempts counted, the key's record is read first. A key that completed,
  is in flight elsewhere or is parked ``unknown`` goes through the claim engine, which replays
  it, waits, or leaves it to reconciliation, and never runs the handler. A key claimed by a
  transaction still open on another consumer (transactional mode: its row is not visible
  yet) waits, and its next delivery looks again. Only a key with no record (or one proven
  not executed, or expired) is dead-lettered, reason ``max_deliveries``.
* A store outage while counting or reading is a wait (the delivery is held and tried again):
  it never spends the budget and never dead-letters. Nor does a counted run that only waited
  (the claim met a lock wait, an outage, or another owner of the key): its attempt is taken
  back. Brokers that hand a wait back (Redis, NATS) redeliver it as a suspect again, which
  would otherwise spend the budget of a key whose handler never started.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from consumer_idem import handler_runs
from consumer_idem.backoff import Backoff
from consumer_idem.consumer import Action, IdempotentConsumer, Verdict
from consumer_idem.errors import ConsumerIdemError, StoreRejected, StoreUnavailable
from consumer_idem.message import ConsumerMessage
from consumer_idem.stores.postgres.attempts import DeliveryAttempts
from consumer_idem.transports.run_gate import process_gate
from consumer_idem.transports.settle import is_wait

log = logging.getLogger("consumer_idem.transports")

V = TypeVar("V")

#: runs a prepared delivery (its message, key and fingerprint) through the claim engine
Execute = Callable[[ConsumerMessage, str, str], Awaitable[Verdict]]

#: record states whose key the claim engine settles without running the handler
SETTLED_ELSEWHERE = frozenset({"completed", "in_progress", "unknown"})


class DeliveryBudget:
    """``max_deliveries`` (None: no limit) attempts of each key of ``consumer``."""

    def __init__(self, consumer: IdempotentConsumer, max_deliveries: int | None) -> None:
        self.consumer = consumer
        self.limit = max_deliveries
        self.attempts = DeliveryAttempts(consumer.store)
        self._outage = Backoff(consumer.backoff_base, consumer.backoff_max)
        self._outages = 0

    def suspect(
        self, view: Callable[[], ConsumerMessage], execute: Execute | None = None
    ) -> Callable[[], Awaitable[Verdict]]:
        """One redelivered delivery's processing, for
        `process_holding` (``view`` gives a fresh view of
        it per try: a handler that changed a parsed body must not hand its change on). However
        often it is tried again while held in hand, the delivery counts one attempt.
        ``execute``: how the counted delivery runs (default: the consumer's ``execute``; an
        integration that hands the handler more than the message wraps it)."""
        counted: list[int] = []
        run = execute if execute is not None else self.consumer.execute

        async def attempt() -> Verdict:
            message = view()
            prepared = self.consumer.prepare(message)
            if isinstance(prepared, Verdict):
                return prepared  # no key: dead-lettered with its reason, as when fresh
            key, fingerprint = prepared
            async with process_gate().alone():  # a crash is then the running one's
                return await self.run_counted(key, counted, lambda: run(message, key, fingerprint))

        return attempt

    async def run_counted(
        self, key: str, counted: list[int], run: Callable[[], Awaitable[Verdict]]
    ) -> Verdict:
        """A redelivered delivery of ``key``, inside ``process_gate().alone()``: admitted
        (`admit`), then ``run``; a run that only waited gives its attempt back. Every path
        that counts a suspect ahead of its handler (a single delivery, a batch member run
        alone) goes through here, so none of them spends the budget on a wait. An attempt is a
        handler start (`consumer_idem.handler_runs`): a wait after the handler started (its
        own statement timed out, its connection dropped) keeps it, or a handler that always
        does so would run for ever."""
        refused = await self.admit(key, counted)
        if refused is not None:
            return refused
        with handler_runs.watching() as started:
            verdict = await run()
        if counted and counted[0] and is_wait(verdict) and not started[0]:
            await self._give_back(key, counted)
        return verdict

    async def _give_back(self, key: str, counted: list[int]) -> None:
        """A counted run only waited before its handler started (the store did not answer, a
        lock wait, or another owner holds the key): it spent nothing, so its attempt is taken
        back, and the next try of the delivery counts itself again. A broker that hands a
        wait back (Redis, NATS) would otherwise spend the budget of a key that never ran on
        every redelivery of a wait, then dead-letter it. While the store does not answer even
        that, the attempt stays spent (one per suspect that was running as the outage
        began)."""
        try:
            await self.attempts.give_back(self.consumer.scope, key)
        except ConsumerIdemError as exc:
            log.warning("scope=%s key=%s: attempt kept: %r", self.consumer.scope, key, exc)
            return
        counted.clear()

    async def admit(self, key: str, counted: list[int]) -> Verdict | None:
        """A redelivered delivery of ``key``, inside ``process_gate().alone()``: counted once
        (``counted``: kept by the caller across its tries, however often it is tried again
        while held in hand). None: run it; else its verdict (the budget is spent, or the store
        does not answer)."""
        consumer = self.consumer
        try:
            if not counted:  # once per delivery, however often it is tried again
                n = await self.attempts.count(consumer.scope, key, self.limit)
                if n is None and not await self._settled_elsewhere(key):
                    # no record to read: one may be on its way, in a transaction still open on
                    # another consumer (transactional mode); what it ends with decides, at the
                    # next delivery (a replay, or this dead letter)
                    held = await self._probe(key)
                    if held == "open":
                        return Verdict(
                            Action.RETRY,
                            consumer.scope,
                            key,
                            reason="in_progress",
                            retry_after=consumer.backoff_base,
                        )
                    if held == "none" or not await self._settled_elsewhere(key):
                        return Verdict(
                            Action.DEAD_LETTER, consumer.scope, key, reason="max_deliveries"
                        )
                counted.append(n or 0)
        except StoreUnavailable:
            self._outages += 1
            return Verdict(
                Action.RETRY,
                consumer.scope,
                key,
                reason="store_unavailable",
                retry_after=self._outage.delay(self._outages),
            )
        self._outages = 0
        return None

    def fresh(self, process: Callable[[], Awaitable[V]]) -> Callable[[], Awaitable[V]]:
        """A first delivery's (or batch's) processing, ``process``, held back while a suspect
        runs alone (in-process only: no round trip)."""

        async def attempt() -> V:
            async with process_gate().shared():
                return await process()

        return attempt

    async def failed(self, verdict: Verdict) -> None:
        """A first delivery's handler failed (``verdict``: its retry): one attempt of its key,
        counted now that it is known to have run (a first delivery is not counted ahead: that
        would cost a write per message). Uncounted when the store does not answer: the next
        delivery counts itself."""
        if verdict.key is not None:
            with contextlib.suppress(ConsumerIdemError):
                await self.attempts.count(verdict.scope, verdict.key)

    async def _probe(self, key: str) -> str:
        """Who has ``key`` (`FastPath.probe_claim`). A probe the table refuses for its data
        (a constraint of the deployment's own, say a CHECK on ``fingerprint``) tells nothing:
        then the key counts as nobody's, the verdict it had before the probe existed, rather
        than a refusal handed back to the broker at every try."""
        try:
            return await self.consumer.store.fast_path.probe_claim(self.consumer.scope, key)
        except StoreRejected as exc:
            log.warning(
                "scope=%s key=%s: the claim probe was refused: %s", self.consumer.scope, key, exc
            )
            return "none"

    async def _settled_elsewhere(self, key: str) -> bool:
        """Whether ``key``'s record says its work is done, running or parked (the claim engine
        then replays, waits or leaves it to reconciliation, and never runs the handler)."""
        record = await self.consumer.store.get(self.consumer.scope, key)
        return record is not None and record.status in SETTLED_ELSEWHERE
