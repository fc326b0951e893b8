"""Deterministic failures are not outages: a result that cannot be stored, a missing schema, a
sync handler, a poison or too deeply nested body, a driver misuse, a lock wait; only a
database outage is ``StoreUnavailable``.

Each test names the mistake it exists to catch."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Action,
    ConsumerMessage,
    PoisonMessage,
    PostgresStore,
    idempotent_consumer,
)
from consumer_idem.errors import SchemaMissing
from consumer_idem.stores.postgres.errors import is_database_outage, kind_of
from tests import _core_units
from tests._core_units import msg, rows

ledger = _core_units.ledger  # a fixture: the effect table


@pytest.mark.parametrize(
    "result",
    [{"name": "\ud800"}, {"blob": b"\x00"}, float("nan")],
    ids=["lone-surrogate", "bytes", "nan"],
)
async def test_a_result_that_cannot_be_stored_dead_letters_at_once_with_its_cause(
    store: PostgresStore, scope: str, result: Any
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, max_attempts=5)
    async def echo(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        return result

    verdict = await echo.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER, verdict
    assert verdict.reason == "unstorable_result"
    assert verdict.error is not None and "UnstorableResult" in verdict.error
    assert calls == 1  # not retried: it would fail the same way every time
    assert echo._store_failures == 0  # and never counted as an outage


async def test_a_missing_schema_fails_fast_and_names_the_fix(pg_pool: asyncpg.Pool) -> None:
    store = PostgresStore(pg_pool, schema="never_migrated")
    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await store.check_schema()

    @idempotent_consumer(store, scope="s")
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await handler.process(msg("k", {"n": 1}))


async def test_the_migrated_schema_passes_the_start_check(store: PostgresStore) -> None:
    await store.check_schema()


def test_only_outages_are_store_unavailable() -> None:
    from consumer_idem.errors import StoreRejected, StoreUnavailable

    assert kind_of(ConnectionRefusedError()) is StoreUnavailable
    assert kind_of(TimeoutError()) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.AdminShutdownError("bye")) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.SerializationError("retry")) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.UndefinedTableError("no")) is SchemaMissing
    assert kind_of(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate")) is StoreRejected
    assert kind_of(asyncpg.exceptions.InvalidTextRepresentationError("bad")) is StoreRejected
    # a connection asyncpg took back after the server terminated it: an outage, not bad data
    released = asyncpg.InterfaceError(
        "cannot call Connection.execute(): connection has been released back to the pool"
    )
    assert kind_of(released) is StoreUnavailable


def test_a_sync_handler_is_refused_when_decorating(store: PostgresStore) -> None:
    def sync_handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    with pytest.raises(TypeError, match="async"):
        idempotent_consumer(store, scope="s")(sync_handler)


async def test_a_poison_message_is_logged_as_poison(
    store: PostgresStore, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    @idempotent_consumer(store, scope=scope)
    async def picky(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        raise PoisonMessage("amount_missing", "no amount")

    with caplog.at_level(logging.INFO, logger="consumer_idem"):
        verdict = await picky.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "amount_missing"
    assert any("poison" in r.getMessage() for r in caplog.records)
    assert not any("failed_retryable" in r.getMessage() for r in caplog.records)
    # the key stays free: a corrected copy (another payload, the same key) runs, no misuse
    assert await store.get(scope, "k") is None

    @idempotent_consumer(store, scope=scope)
    async def fixed(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    corrected = await fixed.process(msg("k", {"n": 1, "amount": 5}))
    assert corrected.action is Action.ACK and not corrected.duplicate


async def test_a_driver_misuse_in_a_handler_is_a_failure_not_an_outage(
    store: PostgresStore, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope, max_attempts=2, backoff=(0.01, 0.05))
    async def nested(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        async with conn.transaction():  # asyncpg refuses: the library opened the transaction
            pass

    first = await nested.process(msg("k", {"n": 1}))
    second = await nested.process(msg("k", {"n": 1}))
    assert first.reason == "failed_retryable" and second.action is Action.DEAD_LETTER
    # the handler's misuse is its own failure; the same from a statement of the library's
    # would be a bug of the deployed code, waited out rather than dead-lettering a backlog
    assert not is_database_outage(asyncpg.InterfaceError("the server expects 1 argument"))


async def test_a_body_nested_too_deeply_is_dead_lettered_not_a_crash(
    store: PostgresStore, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope)
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    deep = ConsumerMessage(body=b"[" * 100_000, headers={"idempotency-key": b"k"})
    verdict = await handler.process(deep)
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "invalid_json"


async def test_a_lock_wait_in_the_handler_is_a_wait_not_a_handler_failure(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO unit_ledger VALUES ($1, 'hot', 0)", scope)

    @idempotent_consumer(store, scope=scope, max_attempts=1, backoff=(0.01, 0.05))
    async def bump(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("SET LOCAL lock_timeout = '100ms'")
        await conn.execute(
            "UPDATE unit_ledger SET amount = amount + 1 WHERE scope = $1 AND key = 'hot'", scope
        )

    async with pg_pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        await holder.execute(
            "SELECT 1 FROM unit_ledger WHERE scope = $1 AND key = 'hot' FOR UPDATE", scope
        )
        waiting = await bump.process(msg("k", {"n": 1}))
        await tx.rollback()
    # max_attempts=1: had it counted as a handler failure, it would be dead-lettered now
    assert waiting.action is Action.RETRY and waiting.reason == "store_unavailable", waiting
    done = await bump.process(msg("k", {"n": 1}))
    assert done.action is Action.ACK and not done.duplicate
    assert await rows(pg_pool, scope) == {"hot": 1}
