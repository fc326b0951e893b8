"""The claim engine (``consumer_idem.claim``) and ``run_transactional`` on it: a commit Postgres
rolled back is a handler failure on every path, never ``executed``, never cached."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    CompletedCache,
    OutcomeKind,
    PostgresStore,
    Status,
    run_transactional,
)
from consumer_idem.errors import CommitRolledBack

FP = "v1:jcs:claim"


@pytest.fixture(scope="module")
async def rows(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS claim_rows (id text PRIMARY KEY)")
    return "claim_rows"


async def count(pool: asyncpg.Pool, row_id: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM claim_rows WHERE id = $1", row_id))


def swallowing(scope: str, result: Any = None) -> Any:
    """A handler with the classic bug: a statement fails, the error is caught without a
    savepoint, and the handler returns as if all went well (the transaction is aborted)."""

    async def handler(conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-effect")
        try:  # noqa: SIM105 (the bug as users write it)
            await conn.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-taken")
        except asyncpg.UniqueViolationError:
            pass
        return result

    return handler


def good(scope: str) -> Any:
    async def handler(conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-effect")
        return "done"

    return handler


@pytest.mark.parametrize("result", [None, {"id": 1}], ids=["no_result", "with_result"])
async def test_a_rolled_back_commit_is_a_retryable_failure(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows: str, scope: str, result: Any
) -> None:
    await pg_pool.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-taken")
    outcome = await run_transactional(store, scope, "k", FP, swallowing(scope, result))
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE and not outcome.ackable
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    assert await count(pg_pool, f"{scope}-effect") == 0
    retry = await run_transactional(store, scope, "k", FP, good(scope))
    assert retry.kind is OutcomeKind.EXECUTED and retry.attempts == 2
    assert await count(pg_pool, f"{scope}-effect") == 1


async def test_a_rolled_back_commit_of_a_reacquired_key_is_a_retryable_failure(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows: str, scope: str
) -> None:
    """The key failed once (failed_retryable): the retry re-acquires it through reserve and
    completes with the owner token; that completion meets the aborted transaction."""
    await pg_pool.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-taken")

    async def broken(conn: asyncpg.Connection) -> Any:
        raise RuntimeError("first attempt fails")

    assert (await run_transactional(store, scope, "k", FP, broken)).attempts == 1
    outcome = await run_transactional(store, scope, "k", FP, swallowing(scope))
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    assert record.attempts == 2
    fixed = await run_transactional(store, scope, "k", FP, good(scope))
    assert fixed.kind is OutcomeKind.EXECUTED and fixed.attempts == 3
    assert await count(pg_pool, f"{scope}-effect") == 1


@pytest.fixture
async def cached_store(
    pg_pool: asyncpg.Pool, redis_client: aioredis.Redis, redis_prefix: str
) -> AsyncIterator[PostgresStore]:
    cache = CompletedCache(redis_client, prefix=redis_prefix)
    yield PostgresStore(pg_pool, cache=cache)


async def test_a_rolled_back_commit_is_never_cached(
    cached_store: PostgresStore, pg_pool: asyncpg.Pool, rows: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-taken")
    outcome = await run_transactional(cached_store, scope, "k", FP, swallowing(scope))
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE
    assert isinstance(outcome.error, CommitRolledBack)
    assert cached_store.cache is not None
    assert await cached_store.cache.get(scope, "k") is None
    retry = await run_transactional(cached_store, scope, "k", FP, good(scope))
    assert retry.kind is OutcomeKind.EXECUTED


async def test_the_engine_rolls_back_when_the_work_escapes_it(
    store: PostgresStore, pg_pool: asyncpg.Pool, rows: str, scope: str
) -> None:
    from consumer_idem.claim import TransactionalClaim

    async with store.connection() as conn:
        with pytest.raises(KeyError):
            async with TransactionalClaim(store, conn, scope, "k", FP) as claim:
                assert claim.decision is None  # ours
                await conn.execute("INSERT INTO claim_rows VALUES ($1)", f"{scope}-effect")
                raise KeyError("escapes")
        assert not conn.is_in_transaction()
    assert await store.get(scope, "k") is None  # never existed: the claim rolled back too
    assert await count(pg_pool, f"{scope}-effect") == 0
