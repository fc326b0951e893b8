"""A completed-record cache in Redis in front of the Postgres store."""

# --8<-- [start:cache]
import os

import redis.asyncio as aioredis

from consumer_idem import CompletedCache, PostgresStore

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
REDIS_URL = os.environ.get(
    "CONSUMER_IDEM_REDIS_URL", "redis://127.0.0.1:6379/0"
)

redis = aioredis.from_url(
    REDIS_URL, socket_timeout=None, socket_connect_timeout=0.25
)
# the Redis client stays yours (close it at shutdown)
store = PostgresStore.from_dsn(DSN, cache=CompletedCache(redis, ttl=3600))
# --8<-- [end:cache]


async def main() -> None:
    import uuid

    import asyncpg

    from consumer_idem import OutcomeKind, fingerprint_bytes, run_transactional

    await store.migrate()

    async def work(conn: asyncpg.Connection) -> str:
        return "done"

    key, fp = f"k-{uuid.uuid4().hex[:8]}", fingerprint_bytes(b"payload")
    first = await run_transactional(store, "docs.cached", key, fp, work)
    # answered by Redis
    again = await run_transactional(store, "docs.cached", key, fp, work)
    kinds = (first.kind, again.kind)
    assert kinds == (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED)
    hits = store.metrics.count("cache_hit", "docs.cached")
    print(first.kind, again.kind, "cache hits:", hits)
    assert hits == 1
    await redis.aclose()
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
