"""Races across OS processes and a crash inside a transactional handler."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter

import asyncpg
import pytest

from consumer_idem import OutcomeKind, PostgresStore, run_transactional
from tests._workers import FP, race_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
async def test_fifty_reservers_over_two_processes_execute_once(
    pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore, scope: str, mode: str
) -> None:
    await pg_pool.execute(
        "CREATE TABLE IF NOT EXISTS race_effects (scope text, key text, mode text)"
    )
    start_at = time.time() + 2.0
    args = [(pg_dsn, scope, "hot-key", mode, 25, start_at) for _ in range(2)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as workers:
        results = workers.map(race_worker, args)
    kinds = Counter(kind for per_process in results for kind in per_process)
    assert sum(kinds.values()) == 50
    assert kinds[OutcomeKind.EXECUTED.value] == 1, kinds
    expected_rest = {OutcomeKind.REPLAYED.value, OutcomeKind.IN_PROGRESS.value}
    assert set(kinds) - {OutcomeKind.EXECUTED.value} <= expected_rest, kinds
    if mode == "transactional":
        # duplicates wait on the unique index, so none of them is ever told "in progress"
        assert kinds[OutcomeKind.REPLAYED.value] == 49, kinds
    effects = await pg_pool.fetchval(
        "SELECT count(*) FROM race_effects WHERE scope = $1 AND key = 'hot-key'", scope
    )
    assert effects == 1


async def test_sigkill_inside_transactional_handler_leaves_nothing(
    pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS crash_effects (scope text, key text)")
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._workers",
        pg_dsn,
        scope,
        "k",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=30)
        assert line.strip() == b"IN_HANDLER"
        # the child is inside its open transaction: claim and effect written, not committed
        open_tx = await pg_pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle in transaction' AND query LIKE 'INSERT INTO crash_effects%'"
        )
        assert open_tx == 1
        uncommitted = "SELECT count(*) FROM crash_effects WHERE scope = $1"
        assert await pg_pool.fetchval(uncommitted, scope) == 0
        child.send_signal(signal.SIGKILL)
    finally:
        await asyncio.wait_for(child.wait(), timeout=10)
    assert child.returncode == -signal.SIGKILL

    async def effects() -> int:
        return await pg_pool.fetchval("SELECT count(*) FROM crash_effects WHERE scope = $1", scope)

    # Postgres rolls the dead session's transaction back as soon as the socket closes.
    assert await store.get(scope, "k") is None
    assert await effects() == 0

    async def handler(conn: asyncpg.Connection) -> str:
        await conn.execute("INSERT INTO crash_effects VALUES ($1, 'k')", scope)
        return "retried"

    retry = await run_transactional(store, scope, "k", FP, handler)
    assert retry.kind is OutcomeKind.EXECUTED and retry.attempts == 1
    again = await run_transactional(store, scope, "k", FP, handler)
    assert again.kind is OutcomeKind.REPLAYED
    assert await effects() == 1
