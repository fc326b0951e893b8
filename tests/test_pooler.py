"""The store behind a real PgBouncer in transaction pooling mode (``scripts/services``: 6432).

With ``pooler="transaction"`` nothing lives on a server connection across transactions: no
SQL ``PREPARE`` kept, no session setting, no LISTEN, no asyncpg statement cache. More client
connections than PgBouncer has server connections make every transaction land on whichever
server connection is free, as in production.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from consumer_idem import (
    Action,
    ConfigurationError,
    ConsumerMessage,
    PostgresStore,
    create_pool,
    detect_pooler,
    idempotent_consumer,
)
from consumer_idem.claim import waiters_for
from tests.conftest import with_database

#: more client connections than PgBouncer's default_pool_size (20) server connections
CLIENTS = 30


def database_of(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


@pytest.fixture
async def pooled(own_database: str, pgbouncer_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool through PgBouncer to a database of this test's own, asyncpg's cache off."""
    dsn = with_database(pgbouncer_dsn, database_of(own_database))
    pool = await create_pool(dsn, pooler="transaction", min_size=CLIENTS, max_size=CLIENTS)
    try:
        yield pool
    finally:
        await pool.close()


def msg(key: str) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps({"k": key}).encode(), headers={"idempotency-key": key.encode()}
    )


async def test_migrate_goes_through_the_pooler_once_however_many_start_together(
    pooled: asyncpg.Pool,
) -> None:
    stores = [PostgresStore(pooled, pooler="transaction") for _ in range(4)]
    applied = await asyncio.gather(*(s.migrate() for s in stores))
    assert sum(1 for a in applied if a) == 1, applied  # one of them applied every migration
    await stores[0].check_schema()
    assert not await stores[1].migrate()  # and again later: nothing to do, no error


async def test_behind_a_transaction_pooler_every_unit_goes_through_first_time(
    pooled: asyncpg.Pool,
) -> None:
    store = PostgresStore(pooled, pooler="transaction")
    await store.migrate()
    await pooled.execute("CREATE TABLE booked (key text PRIMARY KEY)")

    @idempotent_consumer(store, scope="pooled", max_attempts=1)
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO booked VALUES ($1)", json.loads(message.body)["k"])

    async def worker(w: int) -> list[Action]:
        # one connection per worker, units back to back on it (the Kafka runner's way: the
        # next unit's claim would ride with this one's COMMIT), and single units in between
        messages = [msg(f"w{w}-{i}") for i in range(10)]
        actions = [v.action for v in await book.process_batch(messages)]
        for i in range(10):
            actions.append((await book.process(msg(f"w{w}-single-{i}"))).action)
            actions.append((await book.process(msg(f"w{w}-single-{i}"))).action)  # duplicate
        return actions

    results = await asyncio.gather(*(worker(w) for w in range(CLIENTS)))
    actions = [a for r in results for a in r]
    assert set(actions) == {Action.ACK}, {a: actions.count(a) for a in set(actions)}
    assert await pooled.fetchval("SELECT count(*) FROM booked") == CLIENTS * 20


async def test_a_pool_that_keeps_asyncpgs_statement_cache_is_refused_at_start(
    own_database: str, pgbouncer_dsn: str
) -> None:
    dsn = with_database(pgbouncer_dsn, database_of(own_database))
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)  # the cache on: the default
    try:
        store = PostgresStore(pool, pooler="transaction")
        with pytest.raises(ConfigurationError, match="statement_cache_size=0"):
            await store.migrate()
        with pytest.raises(ConfigurationError, match="statement_cache_size=0"):
            await store.check_schema()
    finally:
        await pool.close()


async def test_waiters_behind_a_transaction_pooler_poll_instead_of_listening(
    pooled: asyncpg.Pool,
) -> None:
    store = PostgresStore(pooled, pooler="transaction")
    waiters = waiters_for(store)
    assert not waiters.listening and waiters.poll_cap <= 0.25
    async with waiters.watch("s", "k"):
        assert waiters._conn is None  # no connection held for a LISTEN
    with pytest.raises(ConfigurationError, match="pooler='transaction'"):
        PostgresStore(pooled, pooler="statement")  # type: ignore[arg-type]


async def test_the_probe_finds_a_transaction_pooler_and_never_a_direct_server(
    pooled: asyncpg.Pool, pg_pool: asyncpg.Pool
) -> None:
    assert await detect_pooler(pooled) == "transaction"
    assert await detect_pooler(pg_pool) is None  # two open connections never share a backend
