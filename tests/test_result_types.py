"""Typed results: a duplicate gets back a value equal to, and of the same type as, what the
first run returned, through every entry point; a stored result that no longer fits the type
is `StoredResultMismatch`, naming the scope and key."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import asyncpg
import pytest

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
from tests._typed_cases import AT, CASES, ID, Charge, ChargeV2, annotated, same

FP = "v1:jcs:typed"


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


@pytest.mark.parametrize("case", CASES)
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


@pytest.mark.parametrize("case", CASES)
async def test_batch_handler_replays_its_element_type(
    store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def handler(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> Any:
        return [value for _ in msgs]

    consumer = idempotent_consumer(store, scope=scope, batch=True, key=header("idempotency-key"))(
        annotated(handler, list[annotation] | None)  # type: ignore[valid-type]
    )
    batch = [message("a"), message("b")]
    first = await consumer.process_batch(batch)
    again = await consumer.process_batch([m.fresh() for m in batch])
    assert all(v.duplicate for v in again) and not any(v.duplicate for v in first)
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


@pytest.mark.parametrize("case", CASES)
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


async def test_run_two_phase_raises_a_mismatch_for_a_changed_model(
    store: PostgresStore, scope: str
) -> None:
    async def action(attempt: Attempt) -> Any:
        return CASES["model"][1]

    await run_two_phase(store, scope, "k-2", FP, action, result_type=Charge)
    with pytest.raises(StoredResultMismatch) as caught:
        await run_two_phase(store, scope, "k-2", FP, action, result_type=ChargeV2)
    assert caught.value.scope == scope and caught.value.key == "k-2"


@pytest.mark.parametrize("mode", ["transactional", "two_phase", "batch"])
async def test_every_consumer_mode_dead_letters_a_changed_model_naming_scope_and_key(
    store: PostgresStore, scope: str, mode: str
) -> None:
    value = CASES["model"][1]

    def make(annotation: Any) -> Any:
        batch = mode == "batch"

        async def handler(msg: Any, arg: Any) -> Any:
            return [value for _ in msg] if batch else value

        return idempotent_consumer(
            store,
            scope=scope,
            key=header("idempotency-key"),
            mode="two_phase" if mode == "two_phase" else "transactional",
            batch=batch,
        )(annotated(handler, list[annotation] if batch else annotation))

    async def deliver(consumer: Any) -> Any:
        if mode == "batch":
            return (await consumer.process_batch([message("k")]))[0]
        return await consumer.process(message("k"))

    assert (await deliver(make(Charge))).action is Action.ACK
    verdict = await deliver(make(ChargeV2))
    assert verdict.action is Action.DEAD_LETTER, verdict
    assert verdict.reason == "stored_result_mismatch"
    assert verdict.error is not None and scope in verdict.error and "'k'" in verdict.error
    assert "currency" in verdict.error


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


class Opaque:  # a plain class: pydantic cannot build it from JSON
    def __init__(self, n: int) -> None:
        self.n = n


def test_an_annotation_no_replay_can_read_back_refuses_at_decoration_naming_it(
    store: PostgresStore,
) -> None:
    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> Opaque:
        return Opaque(1)

    with pytest.raises(TypeError) as caught:
        idempotent_consumer(store, scope="typed.opaque")(handler)
    text = str(caught.value)
    assert "the return annotation of" in text and "handler" in text and "Opaque" in text
    assert "result_type=None" in text and "arbitrary_types_allowed" not in text
    with pytest.raises(TypeError, match=r"^result_type= names list\[.*Opaque\]"):
        idempotent_consumer(store, scope="typed.opaque", result_type=list[Opaque])(handler)
