"""What :func:`~consumer_idem.testing.assert_idempotent` holds every delivery to.

A failed expectation is a :class:`NotIdempotent` naming the scenario and telling the delivery's
story: every delivery settled and none dead-lettered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from consumer_idem.message import ConsumerMessage
from consumer_idem.testing.broker import Delivery
from consumer_idem.types import Record

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
