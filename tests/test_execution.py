"""Transactional and two-phase execution against the real database."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Ambiguous,
    Attempt,
    DomainError,
    OutcomeKind,
    PostgresStore,
    ResultKind,
    Retryable,
    Status,
    StoreUnavailable,
    run_transactional,
    run_two_phase,
)

FP = "v1:jcs:payload"


@pytest.fixture(scope="module")
async def effects(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute(
        "CREATE TABLE IF NOT EXISTS exec_effects (scope text, key text, note text)"
    )
    return "exec_effects"


async def count_effects(pool: asyncpg.Pool, scope: str, key: str | None = None) -> int:
    if key is None:
        return await pool.fetchval("SELECT count(*) FROM exec_effects WHERE scope = $1", scope)
    return await pool.fetchval(
        "SELECT count(*) FROM exec_effects WHERE scope = $1 AND key = $2", scope, key
    )


def writer(scope: str, key: str, result: Any = "ok", delay: float = 0.0) -> Any:
    async def handler(conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO exec_effects VALUES ($1, $2, 'effect')", scope, key)
        if delay:
            await asyncio.sleep(delay)
        return result

    return handler


async def test_transactional_commits_effect_and_completion_together(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    outcome = await run_transactional(store, scope, "k", FP, writer(scope, "k", {"id": 7}))
    assert outcome.kind is OutcomeKind.EXECUTED and outcome.result == {"id": 7}
    assert outcome.ackable
    dup = await run_transactional(store, scope, "k", FP, writer(scope, "k"))
    assert dup.kind is OutcomeKind.REPLAYED and dup.result == {"id": 7}
    assert await count_effects(pg_pool, scope, "k") == 1


async def test_concurrent_duplicate_waits_then_replays(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    calls = 0

    def counting(delay: float) -> Any:
        inner = writer(scope, "k", "first", delay)

        async def handler(conn: asyncpg.Connection) -> Any:
            nonlocal calls
            calls += 1
            return await inner(conn)

        return handler

    first = asyncio.create_task(run_transactional(store, scope, "k", FP, counting(0.5)))
    await asyncio.sleep(0.1)
    second = await run_transactional(store, scope, "k", FP, counting(0))
    assert (await first).kind is OutcomeKind.EXECUTED
    assert second.kind is OutcomeKind.REPLAYED and second.result == "first"
    assert calls == 1
    assert await count_effects(pg_pool, scope, "k") == 1


async def test_transactional_failure_rolls_back_everything(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    async def broken(conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO exec_effects VALUES ($1, 'k', 'partial')", scope)
        raise RuntimeError("bug in handler")

    outcome = await run_transactional(store, scope, "k", FP, broken)
    assert outcome.kind is OutcomeKind.FAILED_RETRYABLE and not outcome.ackable
    assert isinstance(outcome.error, RuntimeError)
    assert await count_effects(pg_pool, scope) == 0
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.FAILED_RETRYABLE
    second = await run_transactional(store, scope, "k", FP, broken)
    assert second.attempts == 2
    fixed = await run_transactional(store, scope, "k", FP, writer(scope, "k"))
    assert fixed.kind is OutcomeKind.EXECUTED and fixed.attempts == 3
    assert await count_effects(pg_pool, scope) == 1


async def test_transactional_domain_error_is_stored_and_replayed(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    async def declined(conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO exec_effects VALUES ($1, 'k', 'partial')", scope)
        raise DomainError({"error": "card_declined"})

    outcome = await run_transactional(store, scope, "k", FP, declined)
    assert outcome.kind is OutcomeKind.EXECUTED
    assert outcome.result_kind is ResultKind.DOMAIN_ERROR
    dup = await run_transactional(store, scope, "k", FP, writer(scope, "k"))
    assert dup.kind is OutcomeKind.REPLAYED and dup.result == {"error": "card_declined"}
    assert dup.result_kind is ResultKind.DOMAIN_ERROR
    assert await count_effects(pg_pool, scope) == 0


async def test_transactional_ambiguous_parks_unknown(
    store: PostgresStore, effects: str, scope: str
) -> None:
    async def unsure(conn: asyncpg.Connection) -> Any:
        raise Ambiguous("mail server timed out after DATA")

    outcome = await run_transactional(store, scope, "k", FP, unsure)
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now and outcome.ackable
    blocked = await run_transactional(store, scope, "k", FP, unsure)
    assert blocked.kind is OutcomeKind.UNKNOWN and not blocked.parked_now


async def test_transactional_fails_closed_when_store_is_down(effects: str) -> None:
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    called = False

    async def handler(conn: asyncpg.Connection) -> Any:
        nonlocal called
        called = True

    try:
        with pytest.raises(StoreUnavailable):
            await run_transactional(PostgresStore(pool), "s", "k", FP, handler)
    finally:
        await pool.close()
    assert not called


async def test_two_phase_success_with_local_writes(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    seen: list[Attempt] = []

    async def charge(attempt: Attempt) -> Any:
        seen.append(attempt)
        record = await store.get(scope, "k")
        assert record is not None and record.status is Status.IN_PROGRESS  # claim committed
        return {"charge_id": "ch_1"}

    async def local(conn: asyncpg.Connection, result: Any) -> None:
        await conn.execute(
            "INSERT INTO exec_effects VALUES ($1, 'k', $2)", scope, result["charge_id"]
        )

    outcome = await run_two_phase(store, scope, "k", FP, charge, local_writes=local)
    assert outcome.kind is OutcomeKind.EXECUTED and outcome.result == {"charge_id": "ch_1"}
    assert await count_effects(pg_pool, scope) == 1
    dup = await run_two_phase(store, scope, "k", FP, charge, local_writes=local)
    assert dup.kind is OutcomeKind.REPLAYED and len(seen) == 1
    assert seen[0].downstream_key.startswith("ci-")


async def test_two_phase_classification(store: PostgresStore, scope: str) -> None:
    keys: list[str] = []

    async def refused(attempt: Attempt) -> Any:
        keys.append(attempt.downstream_key)
        raise Retryable("connection refused before sending", code="connect_refused")

    async def timed_out(attempt: Attempt) -> Any:
        raise Ambiguous("read timeout after sending")

    async def crashed(attempt: Attempt) -> Any:
        raise KeyError("unclassified")

    async def declined(attempt: Attempt) -> Any:
        raise DomainError({"declined": True})

    retry = await run_two_phase(store, scope, "a", FP, refused)
    assert retry.kind is OutcomeKind.FAILED_RETRYABLE
    record = await store.get(scope, "a")
    assert record is not None and record.last_error is not None
    assert record.last_error.startswith("connect_refused")

    async def ok(attempt: Attempt) -> Any:
        keys.append(attempt.downstream_key)
        return "charged"

    again = await run_two_phase(store, scope, "a", FP, ok)
    assert again.kind is OutcomeKind.EXECUTED and again.attempts == 2
    assert len(keys) == 2 and keys[0] == keys[1]  # the far side sees one key for both attempts

    unknown = await run_two_phase(store, scope, "b", FP, timed_out)
    assert unknown.kind is OutcomeKind.UNKNOWN and unknown.parked_now
    unclassified = await run_two_phase(store, scope, "c", FP, crashed)
    assert unclassified.kind is OutcomeKind.UNKNOWN
    domain = await run_two_phase(store, scope, "d", FP, declined)
    assert domain.kind is OutcomeKind.EXECUTED and domain.result_kind is ResultKind.DOMAIN_ERROR
    assert (await run_two_phase(store, scope, "d", FP, ok)).result == {"declined": True}


async def test_two_phase_owner_that_outlived_its_lease_cannot_complete(
    store: PostgresStore, scope: str
) -> None:
    async def slow(attempt: Attempt) -> Any:
        await asyncio.sleep(0.6)
        await store.maintenance.sweep()  # the sweeper ran while we were slow
        return "too late"

    outcome = await run_two_phase(store, scope, "k", FP, slow, lease=0.3)
    assert outcome.kind is OutcomeKind.UNKNOWN
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN and record.result is None


async def test_two_phase_cancellation_parks_unknown(store: PostgresStore, scope: str) -> None:
    started = asyncio.Event()

    async def hangs(attempt: Attempt) -> Any:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(run_two_phase(store, scope, "k", FP, hangs))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN


async def test_failure_path_does_not_need_a_second_connection(pg_dsn: str, effects: str) -> None:
    """Recording a failure reuses the connection already held: a full pool must not deadlock."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=2, max_size=2)
    assert pool is not None
    tight = PostgresStore(pool, command_timeout=5)
    scope = f"tight-{id(pool)}"

    async def broken(conn: asyncpg.Connection) -> Any:
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    try:
        outcomes = await asyncio.gather(
            *(run_transactional(tight, scope, f"k{i}", FP, broken) for i in range(6))
        )
    finally:
        await pool.close()
    assert {o.kind for o in outcomes} == {OutcomeKind.FAILED_RETRYABLE}


@pytest.mark.parametrize(
    "key", ["$ci$", "x$ci", "$ci", "it's", "$$", "$ci12345678$ tail", "ünï", "a" * 255]
)
async def test_keys_and_results_that_look_like_sql_quoting_round_trip(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str, key: str
) -> None:
    result = {"note": f"{key}$ci$'; DROP TABLE exec_effects; --", "k": key}
    outcome = await run_transactional(store, scope, key, FP, writer(scope, key, result))
    assert outcome.kind is OutcomeKind.EXECUTED
    replay = await run_transactional(store, scope, key, FP, writer(scope, key))
    assert replay.kind is OutcomeKind.REPLAYED and replay.result == result
    record = await store.get(scope, key)
    assert record is not None and record.key == key
    assert await count_effects(pg_pool, scope, key) == 1


async def test_a_domain_error_on_a_soft_pruned_key_is_stored_and_replayed(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects: str, scope: str
) -> None:
    """A key soft-pruned to `expired` is new work again. When that work ends in a domain error,
    the rollback of its claim restores the `expired` row: the domain result must still be
    stored (not a lease left in progress, nor an error out of the unit)."""
    first = await run_transactional(store, scope, "k", FP, writer(scope, "k"))
    assert first.kind is OutcomeKind.EXECUTED
    await pg_pool.execute(
        f"UPDATE {store.table} SET status = 'expired' WHERE scope = $1 AND key = 'k'", scope
    )

    async def declined(conn: asyncpg.Connection) -> Any:
        raise DomainError({"error": "card_declined"})

    outcome = await run_transactional(store, scope, "k", FP, declined)
    assert outcome.kind is OutcomeKind.EXECUTED, outcome
    assert outcome.result_kind is ResultKind.DOMAIN_ERROR
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.COMPLETED, record
    dup = await run_transactional(store, scope, "k", FP, writer(scope, "k"))
    assert dup.kind is OutcomeKind.REPLAYED and dup.result == {"error": "card_declined"}
