"""``PostgresStore.from_dsn``: a store made at import time, its pool opened on first use."""

from __future__ import annotations

import asyncio
import threading
import uuid

import asyncpg
import pytest

from consumer_idem import ConfigurationError, DecisionKind, PostgresStore

FP = "v1:jcs:aaa"


async def connections(pg_dsn: str, name: str) -> int:
    """Server connections open under the application name ``name``."""
    conn = await asyncpg.connect(pg_dsn, timeout=5)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
        )
        return count
    finally:
        await conn.close()


async def settled(pg_dsn: str, name: str, expected: int) -> int:
    """The count once it reaches ``expected`` (a closed backend leaves the view soon after),
    or what it is after five seconds."""
    async with asyncio.timeout(5):
        while (count := await connections(pg_dsn, name)) != expected:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return count


def named_store(pg_dsn: str) -> tuple[PostgresStore, str]:
    name = f"from-dsn-{uuid.uuid4().hex[:8]}"
    store = PostgresStore.from_dsn(
        pg_dsn,
        schema=f"fd_{uuid.uuid4().hex[:8]}",
        min_size=2,
        max_size=2,
        server_settings={"application_name": name},
    )
    return store, name


async def test_a_store_made_before_any_event_loop_opens_its_pool_on_first_use(
    pg_dsn: str,
) -> None:
    store = await asyncio.to_thread(named_store, pg_dsn)  # no running loop where it is made
    made, name = store
    assert await connections(pg_dsn, name) == 0  # nothing opened yet
    try:
        await made.migrate()
        assert (await made.reserve("s", "k", FP)).kind is DecisionKind.EXECUTE
        assert await made.pool.fetchval("SELECT 41 + 1") == 42  # your own queries too
        assert await connections(pg_dsn, name) == 2
    finally:
        await made.close()


async def test_many_tasks_using_a_new_store_at_once_open_exactly_one_pool(
    pg_dsn: str,
) -> None:
    store, name = named_store(pg_dsn)
    await PostgresStore(await asyncpg.create_pool(pg_dsn), schema=store.schema).migrate()
    try:
        # 20 first uses at once, before any pool exists: one pool of 2 connections serves
        # them all (a pool per task would open 40)
        decisions = await asyncio.gather(*(store.reserve("s", f"k{i}", FP) for i in range(20)))
        assert {d.kind for d in decisions} == {DecisionKind.EXECUTE}
        assert await connections(pg_dsn, name) == 2
    finally:
        await store.close()


async def test_close_closes_every_connection_and_a_later_use_opens_a_new_pool(
    pg_dsn: str,
) -> None:
    store, name = named_store(pg_dsn)
    async with store:  # an app's lifespan: open at start-up, closed at shutdown
        await store.migrate()
        assert await connections(pg_dsn, name) == 2
    assert await settled(pg_dsn, name, 0) == 0

    # reopened by its next use (a test suite that starts and stops the app per test)
    assert (await store.reserve("s", "again", FP)).kind is DecisionKind.EXECUTE
    assert await connections(pg_dsn, name) == 2
    await store.close()
    assert await settled(pg_dsn, name, 0) == 0


async def test_an_unreachable_database_fails_open_with_the_outage_and_a_retry_can_succeed(
    pg_dsn: str,
) -> None:
    store = PostgresStore.from_dsn("postgresql://postgres:postgres@127.0.0.1:1/postgres")
    with pytest.raises(OSError):
        await store.open()
    with pytest.raises(OSError):  # a failed creation is not kept: the next use tries again
        await store.open()
    await store.close()  # nothing to close: no error


async def test_a_pool_open_in_another_running_loop_is_refused_until_closed(
    pg_dsn: str,
) -> None:
    store, name = named_store(pg_dsn)
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(store.open(), other).result(timeout=30)
        with pytest.raises(ConfigurationError, match="another event loop"):
            await store.open()
        asyncio.run_coroutine_threadsafe(store.close(), other).result(timeout=30)
        await store.open()  # closed there: this loop opens its own
        assert await connections(pg_dsn, name) == 2
    finally:
        await store.close()
        other.call_soon_threadsafe(other.stop)
        thread.join(timeout=10)
        other.close()
