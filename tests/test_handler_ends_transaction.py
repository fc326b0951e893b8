"""A handler that ends the library's transaction (ROLLBACK, COMMIT, COMMIT; BEGIN), and the
transaction marks and savepoints that keep such a unit from ever running twice or being
reported done.

Each test names the mistake it exists to catch."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Action,
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    Retryable,
    Status,
    idempotent_consumer,
    run_transactional,
)
from consumer_idem.commit import new_mark, savepoint
from tests import _core_units
from tests._core_units import FP, msg, rows
from tests._racing import DuplicateOnRollback, insert_completed

ledger = _core_units.ledger  # a fixture: the effect table


@pytest.mark.parametrize("ends_with", ["ROLLBACK", "COMMIT", "COMMIT; BEGIN"])
async def test_a_handler_that_ends_the_transaction_itself_never_runs_twice(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str, ends_with: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def recovering(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        await conn.execute(ends_with)  # "recovering" from an error, or committing early
        # from here on, autocommitted: durable whatever the library does next
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, f"e{calls}")
        return {"ok": True}

    verdicts = [await recovering.process(msg("k", {"n": 1})) for _ in range(3)]
    assert calls == 1, verdicts  # never run again: what it wrote may be durable
    assert all(v.action is Action.ACK for v in verdicts)
    record = await store.get(scope, "k")
    assert record is not None
    if ends_with == "ROLLBACK":  # its claim went with the rollback: parked for reconciliation
        assert record.status is Status.UNKNOWN and verdicts[0].reconcile
    else:  # its COMMIT committed the claim: that record is the truth
        assert record.status is Status.COMPLETED
    if ends_with == "COMMIT; BEGIN":  # what it wrote in the transaction it began is gone
        assert await rows(pg_pool, scope) == {}


@pytest.mark.parametrize("then", ["", "COMMIT; BEGIN"], ids=["plain", "handler_commits"])
async def test_a_connection_that_lost_the_commit_check_heals_and_never_misreports(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str, then: str
) -> None:
    """The COMMIT's transaction check is a statement prepared on the connection with the claim.
    Gone (a handler deallocated it), the unit's COMMIT is refused: nothing of it committed
    unless the work committed it itself, which is then found and reported as such (not as a
    failure to retry). The connection prepares it again: the next unit goes through."""

    def work(key: str, sql: str = "") -> Any:
        async def write(conn: asyncpg.Connection) -> None:
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, key)
            if sql:
                await conn.execute(sql)

        return write

    async with pg_pool.acquire() as conn:
        first = await run_transactional(store, scope, "k0", FP, work("k0"), conn=conn)
        assert first.kind is OutcomeKind.EXECUTED  # the statements are prepared on conn now
        await conn.execute(f"DEALLOCATE {store.fast_path._check_stmt}")
        lost = await run_transactional(store, scope, "k1", FP, work("k1", then), conn=conn)
        record = await store.get(scope, "k1")
        if then:  # the work's COMMIT committed its write and our completed claim
            assert lost.kind is OutcomeKind.REPLAYED
            assert record is not None and record.status is Status.COMPLETED
            assert await rows(pg_pool, scope) == {"k0": 1, "k1": 1}
        else:
            assert lost.kind is OutcomeKind.FAILED_RETRYABLE
            assert record is not None and record.status is Status.FAILED_RETRYABLE
            assert await rows(pg_pool, scope) == {"k0": 1}
        healed = await run_transactional(store, scope, "k2", FP, work("k2"), conn=conn)
        assert healed.kind is OutcomeKind.EXECUTED
        retried = await run_transactional(store, scope, "k1", FP, work("k1"), conn=conn)
        assert retried.kind is (OutcomeKind.REPLAYED if then else OutcomeKind.EXECUTED)
        assert await rows(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}


async def test_a_duplicate_with_another_payload_committing_after_the_work_rolled_back_is_misuse(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    """The handler ends the transaction itself (``ROLLBACK; BEGIN``): our claim row is gone.
    Right then a message with the same key and another payload claims and commits it. Our
    completed-looking row is not ours: the message is not acked as a replay of the other
    payload (that would lose it), it meets the key again and is dead-lettered as a misuse."""

    async def other_payload() -> None:
        async with pg_pool.acquire() as other, other.transaction():
            await insert_completed(other, store.table, scope, "k", "v1:other")

    duplicates = DuplicateOnRollback(pg_pool, other_payload)
    racing = PostgresStore(duplicates)  # type: ignore[arg-type]

    @idempotent_consumer(racing, scope=scope, backoff=(0.01, 0.05))
    async def recovers(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'k', 1)", scope)
        await conn.execute("ROLLBACK; BEGIN")  # "recovering" from an error: never do this
        duplicates.arm()

    first = await recovers.process(msg("k", {"n": 1}))
    assert duplicates.fired and not (first.action is Action.ACK and first.duplicate), first
    again = await recovers.process(msg("k", {"n": 1}))
    verdict = again if first.action is Action.RETRY else first
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "key_misuse", verdict
    assert await rows(pg_pool, scope) == {}


async def test_a_handler_that_commits_a_reacquired_claim_parks_it_at_once(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def flaky(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Retryable("first attempt fails: the key becomes failed_retryable")
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'before', 1)", scope)
        await conn.execute("COMMIT; BEGIN")  # the re-acquired lease is committed with it
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'after', 1)", scope)
        return {"ok": True}

    first = await flaky.process(msg("k", {"n": 1}))
    assert first.action is Action.RETRY
    second = await flaky.process(msg("k", {"n": 1}))
    third = await flaky.process(msg("k", {"n": 1}))
    assert calls == 2, (second, third)  # what it committed is durable: never run again
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN, record
    assert second.reconcile and second.action is Action.ACK
    assert await rows(pg_pool, scope) == {"before": 1}


async def test_a_handler_that_rolls_back_and_begins_again_commits_nothing_as_done(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, max_attempts=3, backoff=(0.01, 0.05))
    async def recovering(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute("ROLLBACK; BEGIN")  # "recovering", in a transaction of its own
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, f"e{calls}")

    verdicts = [await recovering.process(msg("k", {"n": 1})) for _ in range(3)]
    # never acked as done: its claim was gone, so its writes were rolled back each time
    assert [v.action for v in verdicts] == [Action.RETRY, Action.RETRY, Action.DEAD_LETTER]
    assert verdicts[-1].error is not None and "ended the idempotency transaction" in (
        verdicts[-1].error
    )
    assert await rows(pg_pool, scope) == {}


def test_every_transaction_gets_a_mark_of_its_own() -> None:
    # a mark repeated on a connection would let a transaction the handler began pass the
    # check of an earlier one; and it is put into SQL text, so hex only
    marks = [new_mark() for _ in range(10_000)]
    assert len(set(marks)) == len(marks)
    assert all(m and set(m) <= set("0123456789abcdef") for m in marks)


async def test_the_savepoint_helper_recovers_inside_the_transaction(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 0)", scope)

    @idempotent_consumer(store, scope=scope)
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> str:
        try:
            async with savepoint(conn):
                await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 1)", scope)
        except asyncpg.UniqueViolationError:
            pass  # recovered: the transaction is still good
        await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'booked', 1)", scope)
        return "ok"

    verdict = await book.process(msg("k", {"n": 1}))
    assert verdict.action is Action.ACK and not verdict.duplicate
    assert await rows(pg_pool, scope) == {"taken": 0, "booked": 1}
