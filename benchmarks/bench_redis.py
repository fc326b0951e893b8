"""Redis: the completed-record cache on a duplicate-heavy workload, and the Redis store.

1. 90% duplicates of completed keys, 10% new keys (each a one-row effect), through
   ``run_transactional`` at concurrency 1 and 8: decisions per second with the cache (redis-py,
   nothing else) against the same Postgres store without it, interleaved in one run.
   Target: >= 2.5x at both.
2. Duplicates only, concurrency 1: what one cached duplicate saves, without the new keys' Postgres
   work (which the cache cannot speed up, and which bounds the ratio of 1).
3. reserve + complete per key, concurrency 8: RedisStore against PostgresStore.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from benchmarks.common import entry, interleaved, rate, scratch_database
from consumer_idem import CompletedCache, PostgresStore, RedisStore, run_transactional
from consumer_idem.cli.settings import load_settings

FP = "v1:jcs:bench"
COMPLETED = 500
CONCURRENCY = 8


async def run(per_chunk: int = 2000, chunks: int = 6) -> list[dict[str, Any]]:
    settings = load_settings()
    redis = aioredis.from_url(settings.redis_url, socket_timeout=None, socket_connect_timeout=1)
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    results = []
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY + 2)
        assert pool is not None
        await pool.execute("CREATE TABLE bench_effects (k text)")
        plain = PostgresStore(pool)
        await plain.migrate()
        cache = CompletedCache(redis, prefix=prefix + "cache:")
        cached = PostgresStore(pool, cache=cache)

        async def effect(conn: asyncpg.Connection, key: str = "") -> None:
            await conn.execute("INSERT INTO bench_effects VALUES ($1)", key)

        def workload(store: PostgresStore, scope: str, duplicates: float = 0.9) -> Any:
            rng = random.Random(scope)

            async def op(i: int) -> None:
                if rng.random() < duplicates:
                    key = f"done-{rng.randrange(COMPLETED)}"
                else:
                    key = f"new-{uuid.uuid4().hex}"
                await run_transactional(store, scope, key, FP, lambda c: effect(c, key))

            return op

        scopes = {"plain": "dup-plain", "cached": "dup-cached"}
        for name, store in (("plain", plain), ("cached", cached)):
            for i in range(COMPLETED):  # the completed keys duplicates will hit
                await run_transactional(store, scopes[name], f"done-{i}", FP, effect)

        # a Kafka partition worker is sequential (c1); an HTTP service or a RabbitMQ consumer
        # with a prefetch runs many at once (c8)
        for concurrency in (1, CONCURRENCY):
            n = per_chunk if concurrency > 1 else per_chunk // 2

            async def without(r: int, n: int = n, c: int = concurrency) -> float:
                return await rate(workload(plain, scopes["plain"]), n, c)

            async def with_cache(r: int, n: int = n, c: int = concurrency) -> float:
                return await rate(workload(cached, scopes["cached"]), n, c)

            await without(-1)
            await with_cache(-1)
            base, subject = await interleaved(chunks, without, with_cache)
            results.append(
                entry(
                    f"cache.duplicate_heavy.decisions_per_s.c{concurrency}", subject, "ops/s", base
                )
            )

        async def dups_without(r: int) -> float:
            return await rate(workload(plain, scopes["plain"], 1.0), per_chunk // 2, 1)

        async def dups_with_cache(r: int) -> float:
            return await rate(workload(cached, scopes["cached"], 1.0), per_chunk // 2, 1)

        base, subject = await interleaved(chunks, dups_without, dups_with_cache)
        results.append(entry("cache.duplicates_only.decisions_per_s.c1", subject, "ops/s", base))

        redis_store = RedisStore(redis, prefix=prefix + "store:")

        def reserve_complete(store: Any, scope: str) -> Any:
            async def op(i: int) -> None:
                d = await store.reserve(scope, f"{scope}-{uuid.uuid4().hex}", FP)
                await store.complete(scope, d.record.key, d.token, {"ok": 1})

            return op

        async def pg(r: int) -> float:
            return await rate(reserve_complete(plain, "rc-pg"), per_chunk // 2, CONCURRENCY)

        async def rd(r: int) -> float:
            return await rate(
                reserve_complete(redis_store, "rc-redis"), per_chunk // 2, CONCURRENCY
            )

        await pg(-1)
        await rd(-1)
        base, subject = await interleaved(chunks, pg, rd)
        results.append(entry("redis_store.reserve_complete_per_s", subject, "ops/s", base))
        await pool.close()
    keys = [k async for k in redis.scan_iter(match=prefix + "*")]
    for i in range(0, len(keys), 1000):
        await redis.delete(*keys[i : i + 1000])
    await redis.aclose()
    return results
