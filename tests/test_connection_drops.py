"""A connection to PostgreSQL that drops in the middle of a store call is an outage to wait
out (``StoreUnavailable``), whichever part of the store met it, and leaves nothing half-done:
the network is cut by a proxy at the moment a given statement is sent."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from consumer_idem import OutboxRelay, PostgresStore
from consumer_idem.completion_waiters import notify_sql, waiters_for
from consumer_idem.errors import StoreUnavailable
from tests._outbox import Proxy


class NothingToSend:
    """A relay's sender that is never reached (the outbox is empty)."""

    route = "kafka"

    def permanent(self, exc: BaseException) -> bool:
        return False

    async def send_batch(self, messages: Any) -> list[BaseException | None]:
        raise AssertionError("the outbox is empty")


@pytest.fixture
async def cut_store(pg_dsn: str) -> AsyncIterator[tuple[PostgresStore, Proxy]]:
    """A store in a schema of its own whose one pooled connection goes through a proxy."""
    schema = f"drops_{uuid.uuid4().hex[:10]}"
    direct = await asyncpg.connect(pg_dsn)
    target = urlsplit(pg_dsn)
    proxy = Proxy(target.hostname or "127.0.0.1", target.port or 5432)
    port = await proxy.start()
    netloc = f"{target.netloc.rsplit('@', 1)[0]}@127.0.0.1:{port}"
    pool = await asyncpg.create_pool(
        urlunsplit(target._replace(netloc=netloc)), min_size=1, max_size=1
    )
    assert pool is not None
    store = PostgresStore(pool, schema=schema)
    await store.migrate()
    try:
        yield store, proxy
    finally:
        try:  # a connection a failed test leaked would keep close() waiting
            await asyncio.wait_for(pool.close(), 10)
        except TimeoutError:
            pool.terminate()
        await proxy.close()
        await direct.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await direct.close()


async def test_a_connection_dropped_as_the_outbox_relay_begins_is_an_outage(
    cut_store: tuple[PostgresStore, Proxy],
) -> None:
    store, proxy = cut_store
    relay = OutboxRelay(store, NothingToSend())
    proxy.drop_on(b"BEGIN")
    with pytest.raises(StoreUnavailable):
        await relay.run_once()
    assert proxy.dropped == 1
    assert (await relay.run_once()).sent == 0  # the pool connects anew: the next pass runs


async def test_a_listening_connection_dropped_on_its_way_back_to_the_pool_ends_the_watch(
    cut_store: tuple[PostgresStore, Proxy], pg_dsn: str
) -> None:
    """The HTTP ``wait=`` path listens on a connection of its own while a request waits; one
    that breaks as the pool resets it is the pool's to replace, not the request's error."""
    store, proxy = cut_store
    waiters = waiters_for(store)
    proxy.drop_on(b"RESET ALL")
    async with waiters.watch("s", "k") as settled:
        assert not settled.is_set()
    assert proxy.dropped == 1
    notifier = await asyncpg.connect(pg_dsn)
    try:  # the next wait listens anew and hears the settlement
        async with waiters.watch("s", "k") as settled:
            await notifier.execute(notify_sql(store, "s", "k"))
            await asyncio.wait_for(settled.wait(), 10)
    finally:
        await notifier.close()


async def test_a_new_waiter_listens_anew_after_the_listeners_backend_was_killed(
    cut_store: tuple[PostgresStore, Proxy], pg_dsn: str
) -> None:
    """While one request waits, the backend its listener is on is killed: the pool has taken
    that connection back; the next waiter must listen on a new one and hear its settlement."""
    store, _ = cut_store
    waiters = waiters_for(store)
    admin = await asyncpg.connect(pg_dsn)
    try:
        async with waiters.watch("s", "first"):
            listener = await admin.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE $1", f"LISTEN%{waiters.channel}%"
            )
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", listener)
            for _ in range(100):  # until the client has seen its connection go
                if await _listener_gone(store):
                    break
                await asyncio.sleep(0.02)
            async with waiters.watch("s", "k") as settled:
                await admin.execute(notify_sql(store, "s", "k"))
                await asyncio.wait_for(settled.wait(), 10)
    finally:
        await admin.close()


async def _listener_gone(store: PostgresStore) -> bool:
    try:
        async with store.pool.acquire(timeout=0.01):
            return True
    except TimeoutError:
        return False


async def test_a_waiter_cancelled_while_its_listen_is_on_the_wire_gives_the_connection_back(
    cut_store: tuple[PostgresStore, Proxy],
) -> None:
    """A request's timeout can cancel a waiter in the middle of its LISTEN (a slow network):
    the connection must still go back to the pool, or a pool of one is gone for good."""
    store, proxy = cut_store
    proxy.delay_on(b"LISTEN", 1.0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3), waiters_for(store).watch("s", "k"):
            raise AssertionError("listening before the LISTEN came through")
    async with store.pool.acquire(timeout=10) as conn:  # back once the LISTEN has come through
        assert await conn.fetchval("SELECT 1") == 1
