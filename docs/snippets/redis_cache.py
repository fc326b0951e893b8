"""A completed-record cache in Redis in front of the Postgres store."""

import asyncio
import os
import uuid

import asyncpg
import redis.asyncio as aioredis

from consumer_idem import (
    CompletedCache,
    OutcomeKind,
    PostgresStore,
    fingerprint_bytes,
    run_transactional,
)

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
REDIS_URL = os.environ.get("CONSUMER_IDEM_REDIS_URL", "redis://127.0.0.1:6379/0")


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    # --8<-- [start:cache]
    redis = aioredis.from_url(REDIS_URL, socket_timeout=None, socket_connect_timeout=0.25)
    store = PostgresStore(pool, cache=CompletedCache(redis, ttl=3600))  # the client stays yours
    # --8<-- [end:cache]
    await store.migrate()

    async def work(conn: asyncpg.Connection) -> str:
        return "done"

    key, fp = f"k-{uuid.uuid4().hex[:8]}", fingerprint_bytes(b"payload")
    first = await run_transactional(store, "docs.cached", key, fp, work)
    again = await run_transactional(store, "docs.cached", key, fp, work)  # answered by Redis
    assert (first.kind, again.kind) == (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED)
    print(first.kind, again.kind, "cache hits:", store.metrics.count("cache_hit", "docs.cached"))
    assert store.metrics.count("cache_hit", "docs.cached") == 1
    await redis.aclose()
    await pool.close()


asyncio.run(main())
