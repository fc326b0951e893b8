"""[`assert_idempotent`][consumer_idem.testing.idempotence.assert_idempotent]: is my handler really
safe under duplicates and crashes?

The library makes the *record* exactly-once; whether the *effect* is depends on the handler:
a transactional handler must do all of its work on the connection it is given (a write through
another connection, or a call to another service, survives a rollback and happens again on the
redelivery), and must never end that transaction itself.
[`assert_idempotent`][consumer_idem.testing.idempotence.assert_idempotent] checks this
from the outside, on a real PostgreSQL: it delivers fresh messages once cleanly, then under
duplicates, concurrent duplicates and a fault at each step boundary, and compares what
``effect(conn, message)`` reports with one clean delivery. With ``external=`` it also makes the
handler's own call to another service take effect and then fail
([`ExternalCall`][consumer_idem.testing.idempotence.ExternalCall]).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from consumer_idem.consumer import Action, IdempotentConsumer, Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.operations.reconcile import Resolver
from consumer_idem.stores.postgres.store import ConnectionPool, PostgresStore
from consumer_idem.testing.broker import Delivery, MemoryTransport, deliver, deliver_batch
from consumer_idem.testing.expectations import (
    Effect,
    Expectations,
    Findings,
    MakeMessage,
    NotIdempotent,
    expect_settled,
    story,
)
from consumer_idem.testing.external import ExternalCall
from consumer_idem.testing.external_faults import ExternalFaults
from consumer_idem.testing.faults import FaultyPool
from consumer_idem.testing.handler_faults import HandlerFaults
from consumer_idem.testing.reconciling import reconcile
from consumer_idem.testing.scenarios import (
    BATCH,
    CLEAN,
    TOOK_EFFECT_THEN_FAILED,
    TRANSACTIONAL,
    TWO_PHASE,
    Scenario,
    chosen_scenarios,
    scenario_names,
)

__all__ = [
    "BATCH",
    "CLEAN",
    "TOOK_EFFECT_THEN_FAILED",
    "TRANSACTIONAL",
    "TWO_PHASE",
    "Effect",
    "MakeMessage",
    "NotIdempotent",
    "Report",
    "assert_idempotent",
    "scenario_names",
]


@dataclass
class Report:
    """What [`assert_idempotent`][consumer_idem.testing.idempotence.assert_idempotent] checked (it
    raised otherwise)."""

    mode: str
    batch: bool
    #: the effect of one clean delivery, every scenario's reference
    clean_effect: Any
    #: the scenarios run and passed, in order
    passed: list[str] = field(default_factory=list)
    #: scenarios whose fault found no place to fire (e.g. no statement of the handler's own)
    not_applicable: list[str] = field(default_factory=list)


async def assert_idempotent(
    consumer: IdempotentConsumer,
    make_message: MakeMessage,
    effect: Effect,
    *,
    resolver: Resolver | None = None,
    concurrency: int = 4,
    scenarios: Collection[str] | None = None,
    external: ExternalCall[..., Any] | Sequence[ExternalCall[..., Any]] = (),
) -> Report:
    """Deliver fresh messages to ``consumer`` under every scenario and raise
    [`NotIdempotent`][consumer_idem.testing.idempotence.NotIdempotent] (an ``AssertionError`` naming
    the scenario) when the effect differs
    from one clean delivery.

    * ``consumer``: an ``@idempotent_consumer`` bound to a
    [`PostgresStore`][consumer_idem.testing.idempotence.PostgresStore] (transactional,
      batch or two-phase). The kit runs a copy of it on the same pool and schema, with faults
      injected at the connection level and short retry delays; the pool needs at least two
      connections.
    * ``make_message()``: a fresh
    [`ConsumerMessage`][consumer_idem.testing.idempotence.ConsumerMessage], with a new key on every
    call.
    * ``effect(conn, message)``: what the handler's effect looks like for ``message`` (a count
      of its rows, a balance, the calls a fake service received for it), the same value for
      every message after one clean delivery, and a different one before it. Expose an
      external service's call counter here: that is how a call outside the transaction shows.
    * ``resolver``: the reconciliation resolver for ``unknown`` outcomes (two-phase ambiguity,
      a lost lease). Without one, the kit reconciles from ``effect``: "executed" when the
      effect is there, "not executed" when it is not (a resolver that knows the truth). Pass
      yours to test it as well.
    * ``scenarios``: run only these (names from
    [`scenario_names`][consumer_idem.testing.idempotence.scenario_names]; the clean delivery
      always runs first, as every scenario's reference).
    * ``external``: the handler's calls to other services, each wrapped in an
      [`ExternalCall`][consumer_idem.testing.idempotence.ExternalCall] the handler awaits. "The call
      took effect, then failed" runs once
      per call one clean delivery makes: in the n-th run the n-th call of the delivery runs
      to its end and then raises (a read timeout): the handler must not make it again
      (``Ambiguous``: parked ``unknown`` and reconciled, or a far side that dedupes by
      ``attempt.downstream_key``). ``effect`` must see the call's
      effect (the fake service's charges for the message).

    The scenarios: the clean delivery (executed once, acked, its record ``completed``);
    duplicates, one after the other and concurrent; a crash before the COMMIT, a shutdown
    there, a COMMIT PostgreSQL rolls back, a server refusing a handler statement, a COMMIT
    whose answer is lost, a crash after the commit before the ack, a lost lease (transactional:
    the server ends the unit's session while the handler runs); two-phase: a crash after the
    claim, a lost or rolled-back completion, a lost lease, an ambiguous failure before and
    after the call, each reconciled. After a fault that rolled the unit back, the effect must be
    as before the delivery; after redelivery (and reconciliation), as after one clean delivery;
    and one more duplicate must change nothing.
    """
    calls = [external] if isinstance(external, ExternalCall) else list(external)
    kit = _Kit(consumer, make_message, effect, resolver, concurrency, calls)
    return await kit.run(scenarios)


class _Kit:
    def __init__(
        self,
        consumer: IdempotentConsumer,
        make_message: MakeMessage,
        effect: Effect,
        resolver: Resolver | None,
        concurrency: int,
        external: list[ExternalCall[..., Any]],
    ) -> None:
        user_store = consumer.store
        pool = user_store.pool
        # an asyncpg pool or an adapter (``ConnectionPool``): the kit only acquires from it
        self.pool: ConnectionPool = pool.pool if isinstance(pool, FaultyPool) else pool
        self.faulty = FaultyPool(self.pool)

        def store_on(pool: Any) -> PostgresStore:
            return PostgresStore(
                pool,
                schema=user_store.schema,
                lease=user_store.lease,
                retention=user_store.retention_for,
                hash_invalid_keys=user_store.hash_invalid_keys,
                command_timeout=user_store.command_timeout,
            )

        self.store = store_on(self.faulty)  # the one the consumer under test runs on
        self.plain = store_on(self.pool)  # the kit's own reads, the reconciler
        self.batch = consumer.batch
        self.resolver = resolver
        self.concurrency = concurrency
        self.external = external
        #: faults and injections fired, in order (the fault layer logs into it too)
        self.events: list[str] = self.faulty.log
        self.calls = ExternalFaults(external, self.events)
        self.findings = Findings()
        #: the faults the kit plays around the handler
        self.around = HandlerFaults(
            self.pool,
            self.store.table,
            self.plain,
            consumer.scope,
            self.events,
            self.calls,
            self.findings,
        )
        # short retry delays: the faults are one-off blips; nothing else changes
        options = replace(consumer.options, backoff=(0.01, 0.05))
        self.consumer = IdempotentConsumer(
            self.around.wrap(consumer.handler), store=self.store, options=options
        )
        self.expect = Expectations(
            self.consumer,
            self.pool,
            self.plain,
            make_message,
            effect,
            self.events,
            self.calls,
            self.findings,
        )

    # --- the run ----------------------------------------------------------------------------

    async def run(self, names: Collection[str] | None) -> Report:
        chosen = chosen_scenarios(self.consumer, bool(self.external), names)
        report = Report(self.consumer.mode, self.batch, None)
        try:
            self.calls.arm(lambda: False)  # counts the calls one clean delivery makes
            try:
                await self._clean_delivery()
                self.calls.clean_calls = self.calls.calls_made
            finally:
                self.calls.disarm()
            report.clean_effect = self.expect.clean
            report.passed.append(CLEAN)
            for scenario in chosen:
                if await self._run_each_call(scenario):
                    report.passed.append(scenario.name)
                else:
                    report.not_applicable.append(scenario.name)
        finally:
            self.faulty.disarm()
        return report

    async def _run_each_call(self, scenario: Scenario) -> bool:
        """Run ``scenario``; "the call took effect, then failed" once per external call one
        clean delivery makes, each run failing the next one (a handler may get its first call
        right and its second wrong). False when its fault found no place to fire."""
        if scenario.inject != "took_effect":
            return await self._run(scenario)
        fired = False
        for nth in range(1, max(self.calls.clean_calls, 1) + 1):
            self.calls.fail_call = nth
            fired = await self._run(scenario) or fired
        return fired

    async def _clean_delivery(self) -> None:
        message, key = await self.expect.fresh(CLEAN)
        before = self.expect.before[key]
        (delivery,) = await self._deliver([message])
        final = delivery.final
        if (
            delivery.deliveries != 1
            or not delivery.acked
            or final is None
            or final.action is not Action.ACK
            or final.duplicate
            or final.reason == "unknown"
        ):
            record = await self.plain.get(self.consumer.scope, key)
            raise NotIdempotent(
                CLEAN,
                "one delivery on a healthy database must execute the message once and ack it, "
                f"but: {story(delivery, record)}",
            )
        await self.expect.completed(CLEAN, key, delivery)
        self.expect.clean = await self.expect.effect_of(message)
        if self.expect.clean == before:
            raise NotIdempotent(
                CLEAN,
                f"effect() gives {before!r} before and after a clean delivery: it does not see "
                "the handler's effect, so nothing can be compared (return, e.g., how many rows "
                "the handler wrote for this message)",
            )

    async def _run(self, scenario: Scenario) -> bool:
        """Run one scenario; False when its fault found no place to fire."""
        name = scenario.name
        distinct, sent = await self._messages_of(scenario)
        messages = [m for m, _ in distinct]
        deliveries = await self._play(scenario, messages, sent)
        self.findings.raise_noted()
        if (scenario.fault is not None or scenario.inject is not None) and not self.events:
            return False
        expect_settled(name, deliveries)
        for message, key in distinct:
            await reconcile(
                name,
                message,
                key,
                expect=self.expect,
                resolver=self.resolver,
                redeliver=self._deliver,
            )
            self.findings.raise_noted()  # a redelivery after "not executed" may note one
            await self.expect.completed(name, key, None)
            await self.expect.as_clean(name, message, "after redelivery")
        # and one more duplicate changes nothing
        await self._expect_replayed(name, messages)
        return True

    async def _messages_of(
        self, scenario: Scenario
    ) -> tuple[list[tuple[ConsumerMessage, str]], list[ConsumerMessage]]:
        """The distinct messages of ``scenario`` with their keys, and the messages it sends
        first (in one batch, a message and its duplicate)."""
        in_one_batch = scenario.name == "duplicate in one batch"
        count = 1 if in_one_batch else scenario.together
        distinct = [await self.expect.fresh(scenario.name) for _ in range(count)]
        first = distinct[0][0]
        return distinct, [first, first.fresh()] if in_one_batch else [m for m, _ in distinct]

    async def _play(
        self, scenario: Scenario, messages: list[ConsumerMessage], sent: list[ConsumerMessage]
    ) -> list[Delivery]:
        """Deliver ``sent`` with the scenario's fault armed, then its duplicates (or
        ``messages[0]`` from several consumers at once); every delivery, until settled."""
        self.events.clear()
        self.around.arm(scenario)
        if scenario.fault is not None:
            self.faulty.arm(scenario.fault)
        try:
            if scenario.concurrent:
                runs = await asyncio.gather(
                    *(self._deliver([messages[0].fresh()]) for _ in range(self.concurrency))
                )
                return [d for run in runs for d in run]
            deliveries = await self._deliver(sent, crash_before_ack=scenario.crash_before_ack)
            for _ in range(scenario.duplicates):
                deliveries += await self._deliver([m.fresh() for m in messages])
            return deliveries
        finally:
            self.faulty.disarm()
            self.around.disarm()

    async def _expect_replayed(self, name: str, messages: list[ConsumerMessage]) -> None:
        """One more duplicate of each of ``messages`` is replayed and changes nothing."""
        again = await self._deliver([m.fresh() for m in messages])
        for message, delivery in zip(messages, again, strict=True):
            if delivery.final is None or not delivery.final.duplicate:
                raise NotIdempotent(
                    name, f"a later duplicate was not replayed: {story(delivery, None)}"
                )
            await self.expect.as_clean(name, message, "after a later duplicate")

    # --- delivering -------------------------------------------------------------------------

    async def _deliver(
        self, messages: Sequence[ConsumerMessage], *, crash_before_ack: int = 0
    ) -> list[Delivery]:
        """Deliver ``messages`` (one, or a batch) until settled, as a broker would: a run is
        redelivered from its first unsettled message; each verdict is carried out by the
        transports' settle path on an in-memory transport."""
        transport = MemoryTransport(self.plain)
        if not self.batch:
            one = await deliver(
                self._attempt_one,
                messages[0],
                transport=transport,
                crash_before_ack=crash_before_ack,
                max_deliveries=200,
            )
            return [one]
        return await deliver_batch(
            self._attempt,
            messages,
            transport=transport,
            crash_before_ack=crash_before_ack,
            max_rounds=200,
        )

    async def _attempt_one(self, message: ConsumerMessage) -> Verdict:
        return (await self._attempt([message]))[0]

    async def _attempt(self, messages: list[ConsumerMessage]) -> list[Verdict]:
        """One delivery attempt, watched: if a fault fired in it and the scenario says the unit
        was rolled back, nothing of it may remain."""
        fired = len(self.events)
        try:
            if self.batch:
                verdicts = await self.consumer.process_batch(messages)
            else:
                verdicts = [await self.consumer.process(messages[0])]
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and self.events[fired:] and task.cancelling():
                task.uncancel()  # the kit's own cancellation, not the test's
            await self.expect.rolled_back(self.around.scenario, messages, fired)
            raise
        except Exception:
            await self.expect.rolled_back(self.around.scenario, messages, fired)
            raise
        # a message this attempt settled (batch mode falls back to one by one within the same
        # call, and that may execute it) shows its effect rightly
        unsettled = [
            m for m, v in zip(messages, verdicts, strict=False) if v.action is not Action.ACK
        ]
        await self.expect.rolled_back(
            self.around.scenario, unsettled + messages[len(verdicts) :], fired
        )
        for verdict in verdicts:
            held = verdict.action is Action.RETRY and verdict.reason == "in_progress"
            if held and self.around.owner_dead and verdict.key is not None:
                # the owner's delivery ended: its lease runs out (now, not in 30 s)
                await self.around.expire_lease(verdict.key)
        return verdicts
