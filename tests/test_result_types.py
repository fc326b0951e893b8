"""Typed results: a duplicate gets back a value equal to, and of the same type as, what the
first run returned, through every entry point; a stored result that no longer fits the type
is `StoredResultMismatch`, naming the scope and key."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import asyncpg
import pydantic
import pytest
from typing_extensions import TypedDict  # pydantic reads typing's only from 3.12

from consumer_idem import (
    Action,
    Attempt,
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    StoredResultMismatch,
    header,
    idempotent_consumer,
    run_transactional,
    run_two_phase,
)

FP = "v1:jcs:typed"


class Charge(pydantic.BaseModel):
    id: uuid.UUID
    amount: Decimal
    at: datetime.datetime


class ChargeV2(pydantic.BaseModel):  # a later release: a field the stored result lacks
    id: uuid.UUID
    amount: Decimal
    at: datetime.datetime
    currency: str


@dataclasses.dataclass
class Line:
    sku: str
    qty: int
    price: Decimal


class Totals(TypedDict):
    count: int
    day: datetime.date


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


ID = uuid.UUID("0b9c6a7e-1f1c-4d1e-9a55-3a7f4c2f8e01")
AT = datetime.datetime(2026, 11, 27, 23, 5, tzinfo=datetime.UTC)

#: (annotation, the value the handler returns): one per kind of type
CASES: dict[str, tuple[Any, Any]] = {
    "model": (Charge, Charge(id=ID, amount=Decimal("12.50"), at=AT)),
    "dataclass": (Line, Line("sku-1", 2, Decimal("3.10"))),
    "typeddict": (Totals, Totals(count=3, day=datetime.date(2026, 11, 27))),
    "list_of_models": (list[Charge], [Charge(id=ID, amount=Decimal("1"), at=AT)]),
    "dict_of_dataclasses": (dict[str, Line], {"a": Line("a", 1, Decimal("0.01"))}),
    "decimal": (Decimal, Decimal("12.50")),
    "datetime": (datetime.datetime, AT),
    "date": (datetime.date, datetime.date(2026, 2, 28)),
    "uuid": (uuid.UUID, ID),
    "enum": (Colour, Colour.BLUE),
}


def same(first: Any, again: Any) -> None:
    """Equal, and of the same type all the way down (a list's items, a dict's values)."""
    assert again == first
    assert type(again) is type(first)
    if isinstance(first, list):
        for a, b in zip(first, again, strict=True):
            same(a, b)
    if isinstance(first, dict):
        for name in first:
            same(first[name], again[name])


def annotated(func: Callable[..., Any], annotation: Any) -> Callable[..., Any]:
    func.__annotations__ = {**func.__annotations__, "return": annotation}
    return func


def message(key: str) -> ConsumerMessage:
    return ConsumerMessage(b'{"n": 1}', {"idempotency-key": key.encode()})


@pytest.mark.parametrize("case", CASES)
async def test_decorated_handler_replays_the_annotated_type(
    store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]
    runs = 0

    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal runs
        runs += 1
        return value

    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(
        annotated(handler, annotation)
    )
    first = await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    assert again.duplicate and again.action is Action.ACK and runs == 1
    same(first.result, again.result)


@pytest.mark.parametrize("case", ["model", "decimal", "enum"])
async def test_two_phase_handler_replays_the_annotated_type(
    store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def handler(msg: ConsumerMessage, attempt: Attempt) -> Any:
        return value

    consumer = idempotent_consumer(
        store, scope=scope, mode="two_phase", key=header("idempotency-key")
    )(annotated(handler, annotation))
    first = await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    assert again.duplicate
    same(first.result, again.result)


async def test_batch_handler_replays_its_element_type(store: PostgresStore, scope: str) -> None:
    async def handler(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> Any:
        return [Line(f"s{i}", i, Decimal("2.5")) for i, _ in enumerate(msgs)]

    consumer = idempotent_consumer(store, scope=scope, batch=True, key=header("idempotency-key"))(
        annotated(handler, list[Line] | None)
    )
    batch = [message("a"), message("b")]
    first = await consumer.process_batch(batch)
    again = await consumer.process_batch([m.fresh() for m in batch])
    assert all(v.duplicate for v in again)
    for a, b in zip(first, again, strict=True):
        same(a.result, b.result)


@pytest.mark.parametrize("case", CASES)
async def test_run_transactional_replays_result_type(
    store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def handler(conn: asyncpg.Connection) -> Any:
        return value

    first = await run_transactional(store, scope, "k", FP, handler, result_type=annotation)
    again = await run_transactional(store, scope, "k", FP, handler, result_type=annotation)
    assert first.kind is OutcomeKind.EXECUTED and again.kind is OutcomeKind.REPLAYED
    same(first.result, again.result)


@pytest.mark.parametrize("case", ["model", "datetime", "uuid"])
async def test_run_two_phase_replays_result_type(
    store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def action(attempt: Attempt) -> Any:
        return value

    first = await run_two_phase(store, scope, "k", FP, action, result_type=annotation)
    again = await run_two_phase(store, scope, "k", FP, action, result_type=annotation)
    assert again.kind is OutcomeKind.REPLAYED
    same(first.result, again.result)


async def test_changed_model_is_a_mismatch_naming_scope_and_key(
    store: PostgresStore, scope: str
) -> None:
    async def handler(conn: asyncpg.Connection) -> Any:
        return CASES["model"][1]

    await run_transactional(store, scope, "k-1", FP, handler, result_type=Charge)
    with pytest.raises(StoredResultMismatch) as caught:
        await run_transactional(store, scope, "k-1", FP, handler, result_type=ChargeV2)
    assert caught.value.scope == scope and caught.value.key == "k-1"
    assert scope in str(caught.value) and "currency" in str(caught.value)


async def test_consumer_dead_letters_a_replay_its_changed_model_refuses(
    store: PostgresStore, scope: str
) -> None:
    async def v1(msg: ConsumerMessage, conn: asyncpg.Connection) -> Charge:
        return CASES["model"][1]  # type: ignore[no-any-return]

    async def v2(msg: ConsumerMessage, conn: asyncpg.Connection) -> ChargeV2:
        raise AssertionError("a duplicate never runs")

    make = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    await make(v1).process(message("k"))
    verdict = await make(v2).process(message("k"))
    assert verdict.action is Action.DEAD_LETTER
    assert verdict.reason == "stored_result_mismatch"
    assert verdict.error is not None and scope in verdict.error and "'k'" in verdict.error


async def test_module_level_annotation_is_read_at_decoration(
    store: PostgresStore, scope: str
) -> None:
    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> Charge:
        return Charge(id=ID, amount=Decimal("9.99"), at=AT)

    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(handler)
    first = await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    same(first.result, again.result)


async def test_no_annotation_or_result_type_none_keeps_the_json(
    store: PostgresStore, scope: str
) -> None:
    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> Charge:
        return Charge(id=ID, amount=Decimal("9.99"), at=AT)

    consumer = idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), result_type=None
    )(handler)
    await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    assert again.result == {"id": str(ID), "amount": "9.99", "at": "2026-11-27T23:05:00Z"}


def test_unresolvable_return_annotation_refuses_at_decoration(store: PostgresStore) -> None:
    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> NoSuchType:  # type: ignore[name-defined]  # noqa: F821
        return None

    with pytest.raises(TypeError, match="result_type="):
        idempotent_consumer(store, scope="typed.bad")(handler)


def test_faststream_refuses_a_result_type_it_would_never_read(store: PostgresStore) -> None:
    from faststream.kafka import KafkaBroker

    from consumer_idem import IdempotencyConfigError
    from consumer_idem.faststream import Idempotency

    with pytest.raises(IdempotencyConfigError, match="stored JSON form"):
        Idempotency(store, broker=KafkaBroker(), scope="typed.fs", result_type=Charge)
