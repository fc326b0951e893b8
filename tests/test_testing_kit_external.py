"""The testing kit reaches the handler's own external call (``ExternalCall``), on the real
PostgreSQL: a call that takes effect on the far side and then fails on ours.

A two-phase handler that turns that failure into ``Retryable`` charges twice (the retry makes
the call again); one that raises ``Ambiguous`` parks the key ``unknown`` and reconciliation
finds the charge. Every other scenario passes both: only a fault inside the call tells them
apart.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    Retryable,
    idempotent_consumer,
)
from consumer_idem.testing import ExternalCall, NotIdempotent, assert_idempotent, scenario_names

TOOK_EFFECT = "the call took effect, then failed"


class GatewayTimeout(Exception):
    """What the fake gateway's client raises when no answer came in time."""


class FakeGateway:
    """A far side that charges on every request (it keeps no idempotency keys)."""

    def __init__(self) -> None:
        self.charges: Counter[str] = Counter()

    async def charge(self, payment: str, amount: int) -> dict[str, Any]:
        self.charges[payment] += 1
        return {"charge": f"ch_{payment}", "amount": amount}


def make_message() -> ConsumerMessage:
    key = uuid.uuid4().hex
    return ConsumerMessage(
        json.dumps({"payment": key, "amount": 5}).encode(), {"idempotency-key": key.encode()}
    )


def charging(
    store: PostgresStore, scope: str, call: Any, on_timeout: type[Exception]
) -> IdempotentConsumer:
    """A two-phase handler built on the call it makes (as a factory taking a client is)."""

    @idempotent_consumer(store, scope=scope, mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> dict[str, Any]:
        body = message.json()
        try:
            result: dict[str, Any] = await call(body["payment"], body["amount"])
        except GatewayTimeout as exc:
            raise on_timeout(f"gateway timeout: {exc}") from exc
        return result

    return charge


@pytest.mark.parametrize("on_timeout", [Ambiguous, Retryable])
async def test_every_other_scenario_passes_a_handler_whatever_it_makes_of_a_timeout(
    idem_store: PostgresStore, on_timeout: type[Exception]
) -> None:
    gateway = FakeGateway()
    call = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))
    consumer = charging(idem_store, f"kit.{on_timeout.__name__}", call, on_timeout)

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    # without the call reached, the Retryable handler looks as safe as the Ambiguous one
    report = await assert_idempotent(consumer, make_message, charged)
    assert report.not_applicable == ["commit rolled back", TOOK_EFFECT]


async def test_a_handler_taking_a_timeout_after_the_charge_for_retryable_is_caught(
    idem_store: PostgresStore,
) -> None:
    gateway = FakeGateway()
    call = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))
    consumer = charging(idem_store, "kit.retryable", call, Retryable)

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(consumer, make_message, charged, external=call)
    assert caught.value.scenario == TOOK_EFFECT
    message = str(caught.value)
    assert "after redelivery, the effect is 2; one clean delivery gives 1" in message
    assert "the call took effect, then raised GatewayTimeout" in message
    assert "the handler raised Retryable(gateway timeout: read timeout)" in message
    assert "is Ambiguous" in message and "never Retryable" in message


async def test_a_handler_taking_a_timeout_after_the_charge_for_ambiguous_passes(
    idem_store: PostgresStore,
) -> None:
    gateway = FakeGateway()
    call = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))
    consumer = charging(idem_store, "kit.ambiguous", call, Ambiguous)

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    report = await assert_idempotent(consumer, make_message, charged, external=call)
    assert TOOK_EFFECT in report.passed and report.not_applicable == ["commit rolled back"]
    assert report.passed == [
        n for n in scenario_names(consumer, external=True) if n != "commit rolled back"
    ]
    assert len(call.raised) == 1  # fired once, in its own scenario


async def test_a_transactional_handler_calling_another_service_is_caught_in_the_call(
    idem_store: PostgresStore,
) -> None:
    gateway = FakeGateway()
    call = ExternalCall(gateway.charge)  # the default failure: a TimeoutError

    @idempotent_consumer(idem_store, scope="kit.tx_call")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        body = message.json()
        await call(body["payment"], body["amount"])

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, charged, external=call, scenarios=[TOOK_EFFECT])
    assert caught.value.scenario == TOOK_EFFECT
    assert "raised TimeoutError" in str(caught.value)
    assert "make it a two-phase handler" in str(caught.value)


async def test_an_external_call_outside_the_kit_only_passes_through() -> None:
    gateway = FakeGateway()
    call = ExternalCall(gateway.charge)
    assert await call("p1", 5) == {"charge": "ch_p1", "amount": 5}
    assert gateway.charges == Counter({"p1": 1}) and call.raised == []


async def test_one_call_of_a_delivery_fails_when_a_handler_makes_several(
    idem_store: PostgresStore,
) -> None:
    gateway, ledger = FakeGateway(), FakeGateway()
    charge = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))
    book = ExternalCall(ledger.charge, failure=lambda: GatewayTimeout("read timeout"))

    @idempotent_consumer(idem_store, scope="kit.two_calls", mode="two_phase")
    async def pay(message: ConsumerMessage, attempt: Attempt) -> None:
        body = message.json()
        try:  # both calls at once: whichever ends first fails, the other answers
            await asyncio.gather(
                charge(body["payment"], body["amount"]), book(body["payment"], body["amount"])
            )
        except GatewayTimeout as exc:
            raise Ambiguous("timeout") from exc

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    report = await assert_idempotent(
        pay, make_message, effect, external=[charge, book], scenarios=[TOOK_EFFECT]
    )
    assert report.passed == ["clean delivery", TOOK_EFFECT]
    # a run per call of the clean delivery (two), one call failing in each
    assert len(charge.raised) + len(book.raised) == 2


async def test_a_handler_right_on_its_first_call_and_wrong_on_its_second_is_caught(
    idem_store: PostgresStore,
) -> None:
    """The kit fails each call of a delivery in turn, not only the first: a lookup whose
    timeout is rightly ``Retryable`` (a read), then a charge whose timeout is wrongly so."""
    gateway = FakeGateway()

    async def lookup(payment: str) -> dict[str, Any]:
        return {"customer": payment}  # a read: no effect on the far side

    find = ExternalCall(lookup, failure=lambda: GatewayTimeout("read timeout"))
    charge = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))

    @idempotent_consumer(idem_store, scope="kit.second_call", mode="two_phase")
    async def pay(message: ConsumerMessage, attempt: Attempt) -> Any:
        body = message.json()
        try:
            await find(body["payment"])
            return await charge(body["payment"], body["amount"])
        except GatewayTimeout as exc:
            raise Retryable("gateway timeout") from exc

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(
            pay, make_message, charged, external=[find, charge], scenarios=[TOOK_EFFECT]
        )
    assert "after redelivery, the effect is 2; one clean delivery gives 1" in str(caught.value)
    assert "call 2 of the 2 a delivery makes" in str(caught.value)
    assert len(find.raised) == 1 and len(charge.raised) == 1


async def test_a_handler_answering_a_retry_from_process_memory_is_caught(
    idem_store: PostgresStore,
) -> None:
    """A ``Retryable`` after the charge, "deduped" by a set in process memory: the redelivery
    in the same process charges nothing, but one to another instance (a restart, a rebalance)
    charges again. The kit fails it: a retry after a call took effect must make the call again
    (for a far side deduping by ``attempt.downstream_key`` to answer), not answer from memory."""
    gateway = FakeGateway()
    charge = ExternalCall(gateway.charge, failure=lambda: GatewayTimeout("read timeout"))
    started: set[str] = set()

    @idempotent_consumer(idem_store, scope="kit.memory", mode="two_phase")
    async def pay(message: ConsumerMessage, attempt: Attempt) -> Any:
        body = message.json()
        if body["payment"] in started:
            return {"charge": "already"}
        started.add(body["payment"])
        try:
            return await charge(body["payment"], body["amount"])
        except GatewayTimeout as exc:
            raise Retryable("gateway timeout") from exc

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charges[message.json()["payment"]]

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(pay, make_message, charged, external=charge)
    assert caught.value.scenario == TOOK_EFFECT
    assert "returned without making any of the 1 call(s)" in str(caught.value)
    assert "another instance" in str(caught.value)


async def test_a_retryable_handler_whose_gateway_dedupes_by_downstream_key_passes(
    idem_store: PostgresStore,
) -> None:
    """The kit's other side: a ``Retryable`` after the charge is safe when the far side dedupes
    by ``attempt.downstream_key`` (the retry makes the call, the gateway answers it again)."""
    charges: dict[str, int] = {}
    answers: dict[str, dict[str, Any]] = {}

    async def gateway_charge(idempotency_key: str, payment: str) -> dict[str, Any]:
        if idempotency_key not in answers:
            charges[payment] = charges.get(payment, 0) + 1
            answers[idempotency_key] = {"charge": f"ch_{payment}"}
        return answers[idempotency_key]

    charge = ExternalCall(gateway_charge, failure=lambda: GatewayTimeout("read timeout"))

    @idempotent_consumer(idem_store, scope="kit.dedupes", mode="two_phase")
    async def pay(message: ConsumerMessage, attempt: Attempt) -> Any:
        try:
            return await charge(attempt.downstream_key, message.json()["payment"])
        except GatewayTimeout as exc:
            raise Retryable("gateway timeout") from exc

    async def charged(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return charges.get(message.json()["payment"], 0)

    report = await assert_idempotent(
        pay, make_message, charged, external=charge, scenarios=[TOOK_EFFECT]
    )
    assert report.passed == ["clean delivery", TOOK_EFFECT]
