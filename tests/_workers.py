"""Code run in child processes by the race and crash tests (imported by module path)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import asyncpg

from consumer_idem import Attempt, PostgresStore, run_transactional, run_two_phase

FP = "v1:jcs:race"


async def _race(dsn: str, scope: str, key: str, mode: str, n: int, start_at: float) -> list[str]:
    pool = await asyncpg.create_pool(dsn, min_size=n, max_size=n)
    assert pool is not None
    store = PostgresStore(pool)

    async def effect(conn: Any) -> Any:
        await conn.execute("INSERT INTO race_effects VALUES ($1, $2, $3)", scope, key, mode)
        await asyncio.sleep(0.2)  # widen the window in which duplicates arrive
        return "done"

    async def external(attempt: Attempt) -> Any:
        return await effect(pool)

    async def one() -> str:
        if mode == "transactional":
            outcome = await run_transactional(store, scope, key, FP, effect)
        else:
            outcome = await run_two_phase(store, scope, key, FP, external)
        return outcome.kind.value

    await asyncio.sleep(max(0.0, start_at - time.time()))  # both processes fire together
    try:
        return list(await asyncio.gather(*(one() for _ in range(n))))
    finally:
        await pool.close()


def race_worker(args: tuple[str, str, str, str, int, float]) -> list[str]:
    return asyncio.run(_race(*args))


async def _crash_child(dsn: str, scope: str, key: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    assert pool is not None
    store = PostgresStore(pool)

    async def handler(conn: Any) -> Any:
        await conn.execute("INSERT INTO crash_effects VALUES ($1, $2)", scope, key)
        print("IN_HANDLER", flush=True)  # the parent SIGKILLs us now
        await asyncio.sleep(60)
        return "never"

    await run_transactional(store, scope, key, FP, handler)


if __name__ == "__main__":
    asyncio.run(_crash_child(*sys.argv[1:4]))


async def _park_and_die(dsn: str, scope: str, key: str) -> None:
    """Parks a key as unknown (an Ambiguous failure) and dies before publishing any notice."""
    import os
    import signal

    from consumer_idem import Ambiguous

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    assert pool is not None
    store = PostgresStore(pool)

    async def times_out(attempt: Attempt) -> Any:
        raise Ambiguous("gateway timed out")

    await run_two_phase(store, scope, key, FP, times_out)
    os.kill(os.getpid(), signal.SIGKILL)  # between parking and publishing


def park_and_die(dsn: str, scope: str, key: str) -> None:
    asyncio.run(_park_and_die(dsn, scope, key))
