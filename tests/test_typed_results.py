"""Everyday typed results (``numeric``, ``timestamptz``, ``date``, ``time``, ``uuid`` column
values, and enums of them) are stored as JSON strings, never dead-lettered as unstorable; a
duplicate replays the strings."""

from __future__ import annotations

import decimal
import enum
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from typing import Any

import asyncpg
import pytest

from consumer_idem import ConsumerMessage, PostgresStore, idempotent_consumer
from consumer_idem.consumer import Action
from consumer_idem.fingerprint import fingerprint_json
from consumer_idem.types import OutcomeKind

PAYMENT_ID = uuid.UUID("0b9c5f0e-6a1d-4f51-9a39-2b4c1f7d8e21")


class Currency(enum.Enum):
    EUR = "EUR"


class Fee(enum.Enum):
    STANDARD = decimal.Decimal("0.30")


CASES: list[tuple[str, Any, Any]] = [
    ("decimal", decimal.Decimal("12.50"), "12.50"),
    ("uuid", PAYMENT_ID, str(PAYMENT_ID)),
    (
        "datetime",
        datetime(2026, 11, 27, 23, 5, 0, 123000, tzinfo=UTC),
        "2026-11-27T23:05:00.123000+00:00",
    ),
    (
        "datetime-offset",
        datetime(2026, 11, 27, 23, 5, tzinfo=timezone(timedelta(hours=1))),
        "2026-11-27T23:05:00+01:00",
    ),
    ("date", date(2026, 11, 27), "2026-11-27"),
    ("time", time(23, 5, 1), "23:05:01"),
    ("enum", Currency.EUR, "EUR"),
    ("enum-of-decimal", Fee.STANDARD, "0.30"),
    (
        "nested",
        {"amount": decimal.Decimal("1E+3"), "ids": [PAYMENT_ID], "on": date(2026, 1, 2)},
        {"amount": "1E+3", "ids": [str(PAYMENT_ID)], "on": "2026-01-02"},
    ),
]


@pytest.mark.parametrize(("value", "stored"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_a_typed_result_is_stored_as_json_strings_and_replayed_as_them(
    idem_store: PostgresStore, value: Any, stored: Any
) -> None:
    calls = 0

    @idempotent_consumer(idem_store, scope="typed-results")
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        return value

    message = ConsumerMessage(b'{"n": 1}', {"idempotency-key": b"k-1"})
    first = await handler.process(message)
    assert first.action is Action.ACK, first  # stored, not dead-lettered
    assert first.result == value  # the first run returns the handler's own value

    again = await handler.process(message)
    assert again.action is Action.ACK, again
    assert again.outcome is not None and again.outcome.kind is OutcomeKind.REPLAYED
    assert again.result == stored  # the duplicate: the JSON strings
    assert calls == 1

    record = await idem_store.get("typed-results", "k-1")
    assert record is not None and record.result == stored


def test_payload_fingerprints_do_not_take_the_result_encoding() -> None:
    """The result encoding is not the fingerprint's: a payload with a Decimal is still refused
    by the canonical JSON of fingerprints (RFC 8785 has no Decimal), not silently hashed as a
    string, so no existing fingerprint changes."""
    with pytest.raises((TypeError, ValueError)):
        fingerprint_json({"amount": decimal.Decimal("1.5")})
    assert fingerprint_json({"amount": "1.5"}) != fingerprint_json({"amount": 1.5})
