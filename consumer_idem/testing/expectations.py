"""What [`assert_idempotent`][consumer_idem.testing.assert_idempotent] holds every delivery to.

The effect ``effect(conn, message)`` reports is read before each message's first delivery and
compared with one clean delivery's; a record must end ``completed``, every delivery settled and
none dead-lettered, and an attempt rolled back by a fault must have left no effect at all. A
failed expectation is a [`NotIdempotent`][consumer_idem.testing.expectations.NotIdempotent] naming
the scenario and telling the delivery's
story.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import asyncpg

from consumer_idem.consumer import IdempotentConsumer, Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.stores.postgres.store import ConnectionPool, PostgresStore
from consumer_idem.testing.broker import Delivery
from consumer_idem.testing.external_faults import ExternalFaults
from consumer_idem.testing.scenarios import Scenario
from consumer_idem.types import Record, Status

#: ``effect(conn, message)``: what the handler's effect looks like for ``message`` now
Effect = Callable[[asyncpg.Connection, ConsumerMessage], Awaitable[Any]]
#: ``make_message()``: a fresh message, with a new idempotency key on every call
MakeMessage = Callable[[], ConsumerMessage]


class NotIdempotent(AssertionError):
    """The effect of a delivery under ``scenario`` differs from one clean delivery."""

    def __init__(self, scenario: str, detail: str) -> None:
        super().__init__(f"scenario {scenario!r}: {detail}")
        self.scenario = scenario
        self.detail = detail


class Findings:
    """A finding made where raising would not reach the test (inside the handler, in an
    attempt the consumer settles): the first one, raised by the kit after the delivery."""

    def __init__(self) -> None:
        self.failure: NotIdempotent | None = None

    def note(self, failure: NotIdempotent) -> None:
        if self.failure is None:
            self.failure = failure

    def raise_noted(self) -> None:
        if self.failure is not None:
            raise self.failure


class Expectations:
    def __init__(
        self,
        consumer: IdempotentConsumer,
        pool: ConnectionPool,
        plain: PostgresStore,
        make_message: MakeMessage,
        effect: Effect,
        events: list[str],
        calls: ExternalFaults,
        findings: Findings,
    ) -> None:
        self.consumer = consumer
        self.pool = pool
        self.plain = plain
        self.scope = consumer.scope
        self.two_phase = consumer.mode == "two_phase"
        self.make_message = make_message
        self.effect = effect
        #: faults and injections fired, in order (shared with the kit)
        self.events = events
        self.calls = calls
        #: each key's effect before its first delivery, and one clean delivery's effect
        self.before: dict[str, Any] = {}
        self.clean: Any = None
        self.findings = findings

    # --- the messages and their effects ------------------------------------------------------

    async def fresh(self, name: str) -> tuple[ConsumerMessage, str]:
        """A new message from ``make_message()``, its key, and its effect before delivery."""
        message = self.make_message()
        if inspect.isawaitable(message):
            message = await message
        if not isinstance(message, ConsumerMessage):
            raise TypeError(
                f"make_message() returned {type(message).__name__}, not a ConsumerMessage"
            )
        key = self.key(name, message)
        if key in self.before:
            raise ValueError(f"make_message() returned the key {key!r} twice: make a new one")
        self.before[key] = await self.effect_of(message)
        return message, key

    def key(self, name: str, message: ConsumerMessage) -> str:
        prepared = self.consumer.prepare(message)
        if isinstance(prepared, Verdict):
            raise NotIdempotent(
                name,
                f"the message is dead-lettered before the handler runs ({prepared.reason}): "
                "make_message() must make a message the consumer accepts",
            )
        return prepared[0]

    async def effect_of(self, message: ConsumerMessage) -> Any:
        async with self.pool.acquire() as conn:
            value = self.effect(cast(asyncpg.Connection, conn), message)
            return await value if inspect.isawaitable(value) else value

    # --- checks ------------------------------------------------------------------------------

    async def completed(self, name: str, key: str, delivery: Delivery | None) -> None:
        record = await self.plain.get(self.scope, key)
        if record is None or record.status is not Status.COMPLETED:
            raise NotIdempotent(
                name,
                f"the record is {record.status if record else 'missing'} where one clean "
                f"delivery leaves it completed: {story(delivery, record)}",
            )

    async def as_clean(self, name: str, message: ConsumerMessage, when: str) -> None:
        """``message``'s effect is one clean delivery's."""
        now = await self.effect_of(message)
        if now != self.clean:
            raise NotIdempotent(
                name,
                f"{when}, the effect is {now!r}; one clean delivery gives {self.clean!r}"
                f"{fired(self.events)}{self.calls.hint(self.two_phase)}",
            )

    async def rolled_back(
        self, scenario: Scenario | None, messages: list[ConsumerMessage], since: int
    ) -> None:
        """An attempt in which a fault fired (an event after the first ``since``) and which
        the scenario says was rolled back left nothing of ``messages``' effects (noted, not
        raised: the consumer settles the attempt)."""
        if scenario is None or not scenario.rolled_back or len(self.events) == since:
            return
        if self.findings.failure is not None:
            return
        for message in unique(messages):
            key = self.key(scenario.name, message)
            now = await self.effect_of(message)
            if now != self.before[key]:
                self.findings.failure = NotIdempotent(
                    scenario.name,
                    f"the attempt was rolled back ({', '.join(self.events[since:])}), yet the "
                    f"effect is {now!r} where it was {self.before[key]!r} before the delivery: "
                    "part of the handler's effect is not in the idempotency transaction (a "
                    "write through another connection or pool, a call to another service, or "
                    "a COMMIT of the handler's own), and the redelivery will do it again",
                )
                return


def expect_settled(name: str, deliveries: list[Delivery]) -> None:
    """Every delivery of scenario ``name`` settled, none dead-lettered."""
    for delivery in deliveries:
        if not delivery.acked:
            raise NotIdempotent(name, f"never settled: {story(delivery, None)}")
        if delivery.dead_letter_reason is not None:
            raise NotIdempotent(
                name,
                f"dead-lettered ({delivery.dead_letter_reason}), where one clean delivery "
                f"executes it: {story(delivery, None)}",
            )


def unique(messages: Sequence[ConsumerMessage]) -> list[ConsumerMessage]:
    """The distinct messages of a run (a duplicate inside a batch is the same message)."""
    seen: list[ConsumerMessage] = []
    for message in messages:
        if not any(message.body == m.body and message.headers == m.headers for m in seen):
            seen.append(message)
    return seen


def fired(events: list[str]) -> str:
    return f" (faults: {', '.join(events)})" if events else ""


def story(delivery: Delivery | None, record: Record | None) -> str:
    parts = []
    if delivery is not None:
        verdicts = ", ".join(
            f"{v.action}{' duplicate' if v.duplicate else ''}{f' ({v.reason})' if v.reason else ''}"
            for v in delivery.verdicts
        )
        parts.append(
            f"{delivery.deliveries} deliveries, {delivery.crashes} crashed, verdicts [{verdicts}]"
        )
    if record is not None:
        parts.append(
            f"record {record.status}"
            + (f", last error {record.last_error!r}" if record.last_error else "")
        )
    return "; ".join(parts) or "nothing recorded"
