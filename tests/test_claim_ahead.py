"""The next message's BEGIN and claim ride in the round trip of the previous message's COMMIT
(one message per transaction, a run on one connection: the Kafka runner's partition worker).

A failure in that round trip can come from before our COMMIT (nothing of the unit committed)
or after it (the unit committed; only the next claim failed). These tests pin both sides on the
real Postgres, and a claim begun for a message that then took none (answered from the cache).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    CompletedCache,
    ConsumerMessage,
    PostgresStore,
    Status,
    idempotent_consumer,
)
from consumer_idem.consumer import Action, IdempotentConsumer, Verdict
from consumer_idem.stores.postgres.migrate import per_schema_name
from tests._racing import DuplicateOnRollback, insert_completed


@pytest.fixture(scope="module")
async def ahead_effects(pg_pool: asyncpg.Pool) -> None:
    # no unique constraint: a doubled effect shows as two rows
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS ahead_effects (scope text, key text)")


def message(key: str) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps({"key": key}).encode(), headers={"idempotency-key": key.encode()}
    )


def run(keys: list[str]) -> list[ConsumerMessage]:
    return [message(k) for k in keys]


def consumer(
    store: PostgresStore,
    scope: str,
    deallocate: dict[str, str],
    then: Callable[[], None] = lambda: None,
) -> IdempotentConsumer:
    """Writes one effect row and returns a result; for a key in ``deallocate``, then drops that
    prepared statement of the library's on its connection (as a handler's DEALLOCATE would)
    and calls ``then()``."""

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def book(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        key = msg.json()["key"]
        await conn.execute("INSERT INTO ahead_effects VALUES ($1, $2)", scope, key)
        if key in deallocate:
            await conn.execute(f"DEALLOCATE {per_schema_name(deallocate[key], store.schema)}")
            then()
        return {"booked": key}

    return book


async def effects(pool: asyncpg.Pool, scope: str) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT key, count(*) AS n FROM ahead_effects WHERE scope = $1 GROUP BY key", scope
    )
    return {r["key"]: r["n"] for r in rows}


def executed(verdict: Verdict) -> bool:
    return (
        verdict.action is Action.ACK
        and not verdict.duplicate
        and not verdict.reconcile
        and verdict.outcome is not None
        and verdict.outcome.kind.value == "executed"
    )


async def test_a_next_claim_that_fails_after_the_commit_leaves_the_unit_executed(
    store: PostgresStore, pg_pool: asyncpg.Pool, ahead_effects: None, scope: str
) -> None:
    """k1's COMMIT went through; the claim of k2 riding after it failed (its prepared statement
    was gone). k1 is executed, not a failure nor a duplicate, and k2 claims on its own."""
    book = consumer(store, scope, {"k1": "consumer_idem_claim"})
    verdicts = await book.process_batch(run(["k0", "k1", "k2"]))
    assert [executed(v) for v in verdicts] == [True, True, True], verdicts
    assert await effects(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}
    for key in ("k0", "k1", "k2"):
        record = await store.get(scope, key)
        assert record is not None and record.status is Status.COMPLETED
        assert record.result == {"booked": key}


@pytest.mark.parametrize("gone", ["consumer_idem_result", "consumer_idem_checkdone"])
async def test_a_failure_before_the_commit_is_never_taken_for_one_after_it(
    store: PostgresStore, pg_pool: asyncpg.Pool, ahead_effects: None, scope: str, gone: str
) -> None:
    """k1's result statement (after the check, which noted the mark: the abort undoes that) or
    its check itself is gone: the round trip fails before its COMMIT, in its transaction, as a
    failure of the next claim would. Nothing of k1 committed, so it is a failure to retry (not
    executed), and its retry runs it once."""
    book = consumer(store, scope, {"k1": gone})
    verdicts = await book.process_batch(run(["k0", "k1", "k2"]))
    assert executed(verdicts[0]) and verdicts[1].action is Action.RETRY, verdicts
    assert len(verdicts) == 2  # the rest waits for k1, in order
    assert await effects(pg_pool, scope) == {"k0": 1}
    record = await store.get(scope, "k1")
    assert record is not None and record.status is Status.FAILED_RETRYABLE

    again = consumer(store, scope, {})
    verdicts = await again.process_batch(run(["k1", "k2"]))
    assert [executed(v) for v in verdicts] == [True, True], verdicts
    assert await effects(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}


async def test_a_claim_begun_for_a_message_answered_from_the_cache_is_rolled_back(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    ahead_effects: None,
    scope: str,
) -> None:
    """k0's COMMIT begins k1's transaction and claims k1, but the cache answers k1 (a stale
    entry: its row was removed from Postgres) without a claim of its own. That begun claim must
    not commit with anything: the next message (k2) rolls it back and claims its own key."""
    cached = PostgresStore(pg_pool, cache=CompletedCache(redis_client, prefix=redis_prefix))
    book = consumer(cached, scope, {})
    assert [executed(v) for v in await book.process_batch(run(["k1"]))] == [True]
    await pg_pool.execute(f"DELETE FROM {store.table} WHERE scope = $1 AND key = 'k1'", scope)

    verdicts = await book.process_batch(run(["k0", "k1", "k2"]))
    assert executed(verdicts[0]) and executed(verdicts[2]), verdicts
    assert verdicts[1].action is Action.ACK and verdicts[1].duplicate
    assert await effects(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}
    assert await store.get(scope, "k1") is None  # no completed row without its effect
    for key in ("k0", "k2"):
        record = await store.get(scope, key)
        assert record is not None and record.status is Status.COMPLETED


async def test_a_duplicate_committing_meanwhile_does_not_pass_for_our_commit(
    store: PostgresStore, pg_pool: asyncpg.Pool, ahead_effects: None, scope: str
) -> None:
    """k1's round trip fails before its COMMIT; the moment its transaction is rolled back, a
    duplicate of k1 commits (row and effect). Whether our COMMIT happened is read from our own
    session, not from the row the duplicate wrote: k1 is not reported executed by this run."""
    book = consumer(store, scope, {"k1": "consumer_idem_result"})
    prepared = book.prepare(message("k1"))
    assert not isinstance(prepared, Verdict)

    async def duplicate() -> None:
        async with pg_pool.acquire() as other, other.transaction():
            booked = '{"booked": "elsewhere"}'
            await insert_completed(other, store.table, scope, "k1", prepared[1], booked)
            await other.execute("INSERT INTO ahead_effects VALUES ($1, 'k1')", scope)

    duplicates = DuplicateOnRollback(pg_pool, duplicate)
    racing = PostgresStore(duplicates)  # type: ignore[arg-type]
    book = consumer(racing, scope, {"k1": "consumer_idem_result"}, duplicates.arm)
    verdicts = await book.process_batch(run(["k0", "k1", "k2"]))
    assert duplicates.fired and executed(verdicts[0]), verdicts
    assert not executed(verdicts[1]), verdicts  # its own attempt committed nothing
    assert verdicts[1].action is Action.RETRY or verdicts[1].duplicate, verdicts
    done = await effects(pg_pool, scope)
    assert done["k0"] == 1 and done["k1"] == 1, done  # k1: the duplicate's effect only


@contextlib.asynccontextmanager
async def holding(pool: asyncpg.Pool, book: IdempotentConsumer, key: str) -> AsyncIterator[None]:
    """Another session holds an uncommitted claim of ``key`` (a duplicate in flight) while the
    block runs, and then lets it go."""
    prepared = book.prepare(message(key))
    assert not isinstance(prepared, Verdict)
    async with pool.acquire() as holder:
        await holder.execute("BEGIN")
        await insert_completed(holder, book.store.table, book.scope, key, prepared[1])
        try:
            yield
        finally:
            await holder.execute("ROLLBACK")


async def test_a_next_claim_that_times_out_after_the_commit_leaves_the_unit_executed(
    pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore, ahead_effects: None, scope: str
) -> None:
    """The claim riding after k1's COMMIT waits on k2's row, held uncommitted by another
    session, past the client's command timeout. k1 committed: it is executed, not an outage to
    retry; k2 waits (retry) until the other session lets go, then runs once."""
    timed = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2, command_timeout=0.5)
    assert timed is not None
    try:
        short = PostgresStore(timed, command_timeout=0.5)
        book = consumer(short, scope, {})
        async with holding(pg_pool, book, "k2"):
            verdicts = await book.process_batch(run(["k1", "k2"]))
        assert executed(verdicts[0]), verdicts
        assert len(verdicts) == 2 and verdicts[1].action is Action.RETRY, verdicts
        again = await book.process_batch(run(["k2"]))
        assert [executed(v) for v in again] == [True], again
        assert await effects(pg_pool, scope) == {"k1": 1, "k2": 1}
    finally:
        await timed.close()


async def test_a_session_lock_timeout_on_a_key_held_elsewhere_is_a_wait_not_a_crash(
    store: PostgresStore, pg_pool: asyncpg.Pool, ahead_effects: None, scope: str
) -> None:
    """k1's handler sets a session-level lock_timeout; another session holds k2's claim. The
    claim of k2 riding after k1's COMMIT runs out of it, and so does k2's own claim: k1 is
    executed, k2 waits (retry, in progress) instead of an exception out of the run."""
    book = consumer(store, scope, {})
    slow = consumer(store, scope, {})

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def impatient(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        await conn.execute("SET lock_timeout = '100ms'")  # session-level: outlives the unit
        return await slow.handler(msg, conn)

    async with holding(pg_pool, book, "k2"):
        verdicts = await impatient.process_batch(run(["k1", "k2"]))
    assert executed(verdicts[0]), verdicts
    assert verdicts[1].action is Action.RETRY and verdicts[1].reason == "in_progress", verdicts
    assert [executed(v) for v in await book.process_batch(run(["k2"]))] == [True]
    assert await effects(pg_pool, scope) == {"k1": 1, "k2": 1}
