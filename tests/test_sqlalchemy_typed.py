"""Typed results through the SQLAlchemy integration (`with_session`, the store on the
application's engine): the decorator, batch mode and ``run_transactional`` replay each kind of
result as the type the first run returned; a changed model is a mismatch naming scope and
key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from consumer_idem import (
    Action,
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    StoredResultMismatch,
    header,
    idempotent_consumer,
    run_transactional,
)
from consumer_idem.sqlalchemy import engine_store, with_session
from tests._typed_cases import CASES, Charge, ChargeV2, annotated, same

KEY = header("idempotency-key")
FP = "v1:jcs:sa-typed"


@pytest.fixture(scope="module")
async def sa_engine(pg_dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(make_url(pg_dsn).set(drivername="postgresql+asyncpg"))
    yield engine
    await engine.dispose()


@pytest.fixture
async def sa_store(sa_engine: AsyncEngine, store: PostgresStore) -> PostgresStore:
    return engine_store(sa_engine)  # `store` migrated the schema


def message(key: str) -> ConsumerMessage:
    return ConsumerMessage(b'{"n": 1}', {"idempotency-key": key.encode()})


async def session_read(session: AsyncSession) -> int:
    """A statement through the unit's session: the handler really uses it."""
    return int((await session.execute(text("SELECT 1"))).scalar_one())


@pytest.mark.parametrize("case", CASES)
async def test_a_session_handler_replays_the_annotated_type(
    sa_store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]
    runs = 0

    async def handler(msg: ConsumerMessage, session: AsyncSession) -> Any:
        nonlocal runs
        runs += await session_read(session)
        return value

    consumer = idempotent_consumer(sa_store, scope=scope, key=KEY)(
        with_session(annotated(handler, annotation))
    )
    first = await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    assert again.duplicate and runs == 1
    same(value, first.result)
    same(first.result, again.result)


@pytest.mark.parametrize("case", CASES)
async def test_a_session_batch_handler_replays_its_element_type(
    sa_store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def handler(msgs: list[ConsumerMessage], session: AsyncSession) -> Any:
        await session_read(session)
        return [value for _ in msgs]

    consumer = idempotent_consumer(sa_store, scope=scope, key=KEY, batch=True)(
        with_session(annotated(handler, list[annotation]))  # type: ignore[valid-type]
    )
    first = await consumer.process_batch([message("a"), message("b")])
    again = await consumer.process_batch([message("a"), message("b")])
    assert all(v.duplicate for v in again)
    for a, b in zip(first, again, strict=True):
        same(a.result, b.result)


@pytest.mark.parametrize("case", CASES)
async def test_run_transactional_with_a_session_replays_result_type(
    sa_store: PostgresStore, scope: str, case: str
) -> None:
    annotation, value = CASES[case]

    async def handler(session: AsyncSession) -> Any:
        await session_read(session)
        return value

    run = with_session(handler)
    first = await run_transactional(sa_store, scope, "k", FP, run, result_type=annotation)
    again = await run_transactional(sa_store, scope, "k", FP, run, result_type=annotation)
    assert again.kind is OutcomeKind.REPLAYED
    same(first.result, again.result)


async def test_a_changed_model_is_a_mismatch_naming_scope_and_key(
    sa_store: PostgresStore, scope: str
) -> None:
    value = CASES["model"][1]

    async def handler(msg: ConsumerMessage, session: AsyncSession) -> Any:
        return value

    make = idempotent_consumer(sa_store, scope=scope, key=KEY)
    await make(with_session(annotated(handler, Charge))).process(message("k"))
    verdict = await make(with_session(annotated(handler, ChargeV2))).process(message("k"))
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "stored_result_mismatch"
    assert verdict.error is not None and scope in verdict.error and "'k'" in verdict.error

    async def direct(session: AsyncSession) -> Any:
        return value

    await run_transactional(sa_store, scope, "k2", FP, with_session(direct), result_type=Charge)
    with pytest.raises(StoredResultMismatch) as caught:
        await run_transactional(
            sa_store, scope, "k2", FP, with_session(direct), result_type=ChargeV2
        )
    assert caught.value.scope == scope and caught.value.key == "k2"
