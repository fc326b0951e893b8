""":func:`assert_idempotent`: is my handler really safe under duplicates and crashes?

The library makes the *record* exactly-once; whether the *effect* is depends on the handler:
a transactional handler must do all of its work on the connection it is given (a write through
another connection, or a call to another service, survives a rollback and happens again on the
redelivery), and must never end that transaction itself. :func:`assert_idempotent` checks this
from the outside, on a real PostgreSQL: it delivers fresh messages once cleanly, then under
duplicates, concurrent duplicates and a fault at each step boundary, and compares what
``effect(conn, message)`` reports with one clean delivery. With ``external=`` it also makes the
handler's own call to another service take effect and then fail (:class:`ExternalCall`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import asyncpg

from consumer_idem.consumer import Action, IdempotentConsumer, Verdict
from consumer_idem.errors import Ambiguous
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import encode_notice
from consumer_idem.operations.reconcile import Reconciler, Resolver
from consumer_idem.stores.postgres.store import ConnectionPool, PostgresStore
from consumer_idem.testing.broker import Delivery, MemoryTransport, deliver, deliver_batch
from consumer_idem.testing.expectations import (
    Effect,
    MakeMessage,
    NotIdempotent,
    expect_settled,
    fired,
    story,
    unique,
)
from consumer_idem.testing.external import ExternalCall
from consumer_idem.testing.faults import FaultyPool
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
from consumer_idem.types import Executed, NotExecuted, Record, Status

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
    """What :func:`assert_idempotent` checked (it raised otherwise)."""

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
    :class:`NotIdempotent` (an ``AssertionError`` naming the scenario) when the effect differs
    from one clean delivery.

    * ``consumer``: an ``@idempotent_consumer`` bound to a :class:`PostgresStore` (transactional,
      batch or two-phase). The kit runs a copy of it on the same pool and schema, with faults
      injected at the connection level and short retry delays; the pool needs at least two
      connections.
    * ``make_message()``: a fresh :class:`ConsumerMessage`, with a new key on every call.
    * ``effect(conn, message)``: what the handler's effect looks like for ``message`` (a count
      of its rows, a balance, the calls a fake service received for it), the same value for
      every message after one clean delivery, and a different one before it. Expose an
      external service's call counter here: that is how a call outside the transaction shows.
    * ``resolver``: the reconciliation resolver for ``unknown`` outcomes (two-phase ambiguity,
      a lost lease). Without one, the kit reconciles from ``effect``: "executed" when the
      effect is there, "not executed" when it is not (a resolver that knows the truth). Pass
      yours to test it as well.
    * ``scenarios``: run only these (names from :func:`scenario_names`; the clean delivery
      always runs first, as every scenario's reference).
    * ``external``: the handler's calls to other services, each wrapped in an
      :class:`ExternalCall` the handler awaits. "The call took effect, then failed" runs once
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
        self.two_phase = consumer.mode == "two_phase"
        self.batch = consumer.batch
        self.scope = consumer.scope
        # short retry delays: the faults are one-off blips; nothing else changes
        options = replace(consumer.options, backoff=(0.01, 0.05))
        self.consumer = IdempotentConsumer(
            self._wrap(consumer.handler), store=self.store, options=options
        )
        self.make_message = make_message
        self.effect = effect
        self.resolver = resolver
        self.concurrency = concurrency
        self.external = external
        #: external calls one clean delivery made, and which one fails in this run (1-based)
        self.clean_calls = 0
        self.calls_made = 0
        self.fail_call = 1
        #: this scenario run's external call took effect and failed (later runs are watched)
        self.fired_external = False
        #: what the handler made of its call's failure after it took effect (the exception it
        #: raised, or "returned normally"), for the message of a scenario that then fails
        self.after_external: str | None = None
        #: the kit's own fault armed for the next handler call
        self.inject: str | None = None
        #: faults and injections fired, in order (the fault layer logs into it too)
        self.events: list[str] = self.faulty.log
        #: an owner that can no longer answer (its delivery ended): its lease may run out now
        self.owner_dead = True
        self.scenario: Scenario | None = None
        self.before: dict[str, Any] = {}
        self.failure: NotIdempotent | None = None
        self.clean: Any = None
        #: keys reconciliation resolved "executed"

    # --- the run ----------------------------------------------------------------------------

    async def run(self, names: Collection[str] | None) -> Report:
        chosen = chosen_scenarios(self.consumer, bool(self.external), names)
        report = Report(self.consumer.mode, self.batch, None)
        try:
            self._arm_external(lambda: False)  # counts the calls one clean delivery makes
            try:
                await self._clean_delivery()
                self.clean_calls = self.calls_made
            finally:
                self._disarm_external()
            report.clean_effect = self.clean
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
        for nth in range(1, max(self.clean_calls, 1) + 1):
            self.fail_call = nth
            fired = await self._run(scenario) or fired
        return fired

    def _arm_external(self, fails: Callable[[], bool]) -> None:
        self.calls_made = 0

        def counted() -> bool:
            self.calls_made += 1
            return fails()

        for call in self.external:
            call.arm(counted)

    def _disarm_external(self) -> None:
        for call in self.external:
            call.disarm()

    async def _clean_delivery(self) -> None:
        message, key = await self._fresh(CLEAN)
        before = self.before[key]
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
            record = await self.plain.get(self.scope, key)
            raise NotIdempotent(
                CLEAN,
                "one delivery on a healthy database must execute the message once and ack it, "
                f"but: {story(delivery, record)}",
            )
        await self._expect_completed(CLEAN, key, delivery)
        self.clean = await self._effect(message)
        if self.clean == before:
            raise NotIdempotent(
                CLEAN,
                f"effect() gives {before!r} before and after a clean delivery: it does not see "
                "the handler's effect, so nothing can be compared (return, e.g., how many rows "
                "the handler wrote for this message)",
            )

    async def _run(self, scenario: Scenario) -> bool:
        """Run one scenario; False when its fault found no place to fire."""
        self.scenario = scenario
        name = scenario.name
        distinct, sent = await self._messages_of(scenario)
        messages = [m for m, _ in distinct]
        deliveries = await self._play(scenario, messages, sent)
        if self.failure is not None:
            raise self.failure
        if (scenario.fault is not None or scenario.inject is not None) and not self.events:
            return False
        expect_settled(name, deliveries)
        for message, key in distinct:
            await self._reconcile(name, message, key)
            if self.failure is not None:  # a redelivery after "not executed" may set it
                raise self.failure
            await self._expect_completed(name, key, None)
            await self._expect_clean(name, message, "after redelivery")
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
        distinct = [await self._fresh(scenario.name) for _ in range(count)]
        first = distinct[0][0]
        return distinct, [first, first.fresh()] if in_one_batch else [m for m, _ in distinct]

    async def _play(
        self, scenario: Scenario, messages: list[ConsumerMessage], sent: list[ConsumerMessage]
    ) -> list[Delivery]:
        """Deliver ``sent`` with the scenario's fault armed, then its duplicates (or
        ``messages[0]`` from several consumers at once); every delivery, until settled."""
        self.events.clear()
        self.after_external = None
        self.fired_external = False
        self.inject = scenario.inject
        self.owner_dead = not scenario.concurrent
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
            self.inject = None
            self.owner_dead = True

    async def _expect_replayed(self, name: str, messages: list[ConsumerMessage]) -> None:
        """One more duplicate of each of ``messages`` is replayed and changes nothing."""
        again = await self._deliver([m.fresh() for m in messages])
        for message, delivery in zip(messages, again, strict=True):
            if delivery.final is None or not delivery.final.duplicate:
                raise NotIdempotent(
                    name, f"a later duplicate was not replayed: {story(delivery, None)}"
                )
            await self._expect_clean(name, message, "after a later duplicate")

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
            await self._check_rolled_back(messages, fired)
            raise
        except Exception:
            await self._check_rolled_back(messages, fired)
            raise
        # a message this attempt settled (batch mode falls back to one by one within the same
        # call, and that may execute it) shows its effect rightly
        unsettled = [
            m for m, v in zip(messages, verdicts, strict=False) if v.action is not Action.ACK
        ]
        await self._check_rolled_back(unsettled + messages[len(verdicts) :], fired)
        for verdict in verdicts:
            held = verdict.action is Action.RETRY and verdict.reason == "in_progress"
            if held and self.owner_dead and verdict.key is not None:
                # the owner's delivery ended: its lease runs out (now, not in 30 s)
                await self._expire_lease(verdict.key)
        return verdicts

    async def _check_rolled_back(self, messages: list[ConsumerMessage], fired: int) -> None:
        scenario = self.scenario
        if scenario is None or not scenario.rolled_back or len(self.events) == fired:
            return
        if self.failure is not None:
            return
        for message in unique(messages):
            key = self._key(scenario.name, message)
            now = await self._effect(message)
            if now != self.before[key]:
                self.failure = NotIdempotent(
                    scenario.name,
                    f"the attempt was rolled back ({', '.join(self.events[fired:])}), yet the "
                    f"effect is {now!r} where it was {self.before[key]!r} before the delivery: "
                    "part of the handler's effect is not in the idempotency transaction (a "
                    "write through another connection or pool, a call to another service, or "
                    "a COMMIT of the handler's own), and the redelivery will do it again",
                )
                return

    # --- the faults the kit plays around the handler ---------------------------------------

    def _wrap(self, handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        kit = self

        async def under_test(work: Any, context: Any) -> Any:
            inject, kit.inject = kit.inject, None
            if inject == "ambiguous_before":
                kit.events.append("ambiguous failure before the call")
                raise Ambiguous("injected: the request may have left (a connect timeout)")
            if inject == "took_effect":
                return await kit._took_effect(handler, work, context)
            if kit.fired_external:
                return await kit._after_took_effect(handler, work, context)
            result = await handler(work, context)
            if inject == "ambiguous_after":
                kit.events.append("ambiguous failure after the call")
                raise Ambiguous("injected: the call was made, its answer was lost")
            if inject == "lease_lost":
                kit.events.append("lease lost during the call")
                await kit._expire_lease(context.key)
                await kit.plain.maintenance.sweep()  # the sweeper parks it as unknown
            if inject == "session_killed":
                kit.events.append("the server ended the unit's session")
                await kit._terminate(context)
            return result

        under_test.__name__ = getattr(handler, "__name__", "handler")
        under_test.__doc__ = handler.__doc__
        return under_test

    async def _took_effect(
        self, handler: Callable[..., Awaitable[Any]], work: Any, context: Any
    ) -> Any:
        """Run the handler with its external calls armed: its ``fail_call``-th call takes
        effect, then raises (only that one). Note what the handler made of it."""
        self._arm_external(lambda: self.calls_made == self.fail_call)
        fired = [len(call.raised) for call in self.external]

        def took_effect() -> bool:
            return any(len(c.raised) > n for c, n in zip(self.external, fired, strict=True))

        try:
            result = await handler(work, context)
        except BaseException as exc:
            if took_effect():
                self.after_external = f"raised {type(exc).__name__}({exc})"
            raise
        finally:
            self._disarm_external()
            if took_effect():
                self.fired_external = True
                failure = next(
                    c.raised[-1]
                    for c, n in zip(self.external, fired, strict=True)
                    if len(c.raised) > n
                )
                nth = self.fail_call, self.clean_calls
                self.events.append(
                    f"the call took effect, then raised {type(failure).__name__}"
                    + ("" if nth[1] <= 1 else f" (call {nth[0]} of the {nth[1]} a delivery makes)")
                )
        self.after_external = "returned normally"
        return result

    async def _after_took_effect(
        self, handler: Callable[..., Awaitable[Any]], work: Any, context: Any
    ) -> Any:
        """The handler runs again after its call took effect and failed: it said the work was
        not done (``Retryable``), so it must make its call again, for the far side to answer
        it (a gateway deduping by ``attempt.downstream_key``). Answering without any call
        means it remembered the first one where the kit cannot see: process memory, which a
        redelivery to another instance (a restart, a rebalance) does not have, and the call is
        made twice there."""
        self._arm_external(lambda: False)
        try:
            result = await handler(work, context)
        finally:
            self._disarm_external()
        if self.calls_made == 0 and self.clean_calls > 0 and self.failure is None:
            assert self.scenario is not None
            self.failure = NotIdempotent(
                self.scenario.name,
                f"the external call took effect and then failed; the handler "
                f"{self.after_external}, and when the message was delivered again it returned "
                f"without making any of the {self.clean_calls} call(s) one clean delivery makes: "
                "it remembered the first attempt where the kit cannot see (process memory?). A "
                "redelivery to another instance (a restart, a rebalance) makes the call again "
                "(if it asked the far side, wrap that call in an ExternalCall too). "
                "An error after a call may have taken effect is Ambiguous (the key is parked "
                "unknown and reconciled), never Retryable, unless the far side dedupes it by "
                "attempt.downstream_key",
            )
        return result

    async def _expire_lease(self, key: str) -> None:
        async with self.pool.acquire(timeout=10) as conn:
            await conn.execute(
                f"UPDATE {self.store.table} SET locked_until = now() - interval '1 second'"
                # the token says in progress (see migration 8): no partial index is implied
                " WHERE scope = $1 AND key = $2 AND owner_token IS NOT NULL",
                self.scope,
                key,
            )

    async def _terminate(self, conn: Any) -> None:
        """End the unit's session from the server side, as an operator, a statement timeout or a
        failover does, and wait until its backend is gone (its transaction rolled back)."""
        pid = conn.get_server_pid()
        async with self.pool.acquire(timeout=10) as admin:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            for _ in range(500):
                if not await admin.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid
                ):
                    return
                await asyncio.sleep(0.01)

    # --- reconciliation ---------------------------------------------------------------------

    async def _reconcile(self, name: str, message: ConsumerMessage, key: str) -> None:
        """Settle a record left ``unknown`` as the reconciler would; a "not executed" answer
        re-sends the original, which is delivered again."""
        for _ in range(3):
            record = await self.plain.get(self.scope, key)
            if record is None or record.status is not Status.UNKNOWN:
                return
            transport = MemoryTransport(self.plain)
            writes = self.consumer.local_writes
            reconciler = Reconciler(
                self.plain,
                self.resolver or self._truth(message, key),
                backoff=(0.01, 0.05),
                redispatch_grace=0.0,
                # as an operator's reconciler must: "executed" commits the local rows too
                local_writes=None if writes is None else {self.scope: writes},
            )
            reconciler.attach(transport)
            notice = ConsumerMessage(encode_notice(self.scope, key, record.last_error))
            await deliver(reconciler.process, notice, transport=transport)
            copies = [
                ConsumerMessage(n.body, dict(n.headers))
                for n in transport.redispatched
                if n.body is not None
            ]
            record = await self.plain.get(self.scope, key)
            if record is not None and record.status is Status.FAILED_RETRYABLE and not copies:
                copies = [message.fresh()]  # nothing kept to re-send: the broker redelivers it
            for copy in copies:
                await self._deliver([copy])
        record = await self.plain.get(self.scope, key)
        raise NotIdempotent(name, f"still unknown after reconciliation: {story(None, record)}")

    def _truth(self, message: ConsumerMessage, key: str) -> Resolver:
        async def resolve(record: Record) -> Executed | NotExecuted:
            if await self._effect(message) == self.before[key]:
                return NotExecuted("assert_idempotent: effect() shows no effect")
            return Executed(None)

        return resolve

    # --- checks -----------------------------------------------------------------------------

    async def _expect_completed(self, name: str, key: str, delivery: Delivery | None) -> None:
        record = await self.plain.get(self.scope, key)
        if record is None or record.status is not Status.COMPLETED:
            raise NotIdempotent(
                name,
                f"the record is {record.status if record else 'missing'} where one clean "
                f"delivery leaves it completed: {story(delivery, record)}",
            )

    async def _expect_clean(self, name: str, message: ConsumerMessage, when: str) -> None:
        now = await self._effect(message)
        if now != self.clean:
            raise NotIdempotent(
                name,
                f"{when}, the effect is {now!r}; one clean delivery gives {self.clean!r}"
                f"{fired(self.events)}{self._external_hint()}",
            )

    def _external_hint(self) -> str:
        """Why a handler fails "the call took effect, then failed", in its own terms."""
        if self.after_external is None:
            return ""
        told = (
            f". The external call took effect and then failed; the handler "
            f"{self.after_external}, and the call was made again"
        )
        if not self.two_phase:
            return (
                f"{told}: a transactional handler's call to another service is not rolled back "
                "with its unit (make it a two-phase handler)"
            )
        return (
            f"{told}. An error after a call may have taken effect is Ambiguous (the key is "
            "parked unknown and reconciled), never Retryable, unless the far side dedupes it "
            "by attempt.downstream_key"
        )

    # --- helpers ----------------------------------------------------------------------------

    async def _fresh(self, name: str) -> tuple[ConsumerMessage, str]:
        """A new message from ``make_message()``, its key, and its effect before delivery."""
        message = self.make_message()
        if inspect.isawaitable(message):
            message = await message
        if not isinstance(message, ConsumerMessage):
            raise TypeError(
                f"make_message() returned {type(message).__name__}, not a ConsumerMessage"
            )
        key = self._key(name, message)
        if key in self.before:
            raise ValueError(f"make_message() returned the key {key!r} twice: make a new one")
        self.before[key] = await self._effect(message)
        return message, key

    def _key(self, name: str, message: ConsumerMessage) -> str:
        prepared = self.consumer.prepare(message)
        if isinstance(prepared, Verdict):
            raise NotIdempotent(
                name,
                f"the message is dead-lettered before the handler runs ({prepared.reason}): "
                "make_message() must make a message the consumer accepts",
            )
        return prepared[0]

    async def _effect(self, message: ConsumerMessage) -> Any:
        async with self.pool.acquire() as conn:
            value = self.effect(cast(asyncpg.Connection, conn), message)
            return await value if inspect.isawaitable(value) else value
