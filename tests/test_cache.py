"""The Redis completed-record cache in front of the Postgres store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    CompletedCache,
    DecisionKind,
    OutcomeKind,
    PostgresStore,
    run_transactional,
)
from consumer_idem.settings import Settings

FP = "v1:jcs:aaa"


@pytest.fixture
async def cache_client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(settings.redis_url, socket_timeout=0.2, socket_connect_timeout=0.2)
    yield client
    await client.aclose()


@pytest.fixture(params=["fast_path", "socket_timeout", "no_socket_timeout"])
async def cached_store(
    request: pytest.FixtureRequest,
    settings: Settings,
    pg_pool: asyncpg.Pool,
    cache_client: aioredis.Redis,
    redis_prefix: str,
) -> AsyncIterator[PostgresStore]:
    """The cache's own connection (the default); redis-py with its socket timeout; redis-py
    without one (the cache's own ``timeout`` then bounds every call, so an outage still falls
    through instead of hanging)."""
    if request.param == "no_socket_timeout":
        client = aioredis.from_url(settings.redis_url)
        cache = CompletedCache(client, prefix=redis_prefix, timeout=0.2, fast_path=False)
        yield PostgresStore(pg_pool, cache=cache)
        await client.aclose()
        return
    fast = request.param == "fast_path"
    cache = CompletedCache(cache_client, prefix=redis_prefix, fast_path=fast)
    yield PostgresStore(pg_pool, cache=cache)
    await cache.aclose()


async def cached_keys(redis_client: aioredis.Redis, prefix: str) -> list[bytes]:
    return [k async for k in redis_client.scan_iter(match=prefix + "*")]


async def test_a_duplicate_is_answered_without_postgres(
    pg_dsn: str, cache_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    assert pool is not None
    cache = CompletedCache(cache_client, prefix=redis_prefix)
    store = PostgresStore(pool, cache=cache)
    await store.migrate()

    async def handler(conn: asyncpg.Connection) -> Any:
        return {"id": 1}

    first = await run_transactional(store, scope, "k", FP, handler)
    assert first.kind is OutcomeKind.EXECUTED
    await pool.close()  # from here on, any Postgres call would fail
    dup = await run_transactional(store, scope, "k", FP, handler)
    assert dup.kind is OutcomeKind.REPLAYED and dup.result == {"id": 1}
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.REPLAY
    assert (await store.reserve(scope, "k", "v1:jcs:other")).kind is DecisionKind.MISUSE
    assert store.metrics.count("cache_hit", scope) == 3
    await cache.aclose()


async def test_only_completed_records_are_ever_cached(
    cached_store: PostgresStore, redis_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    running = await cached_store.reserve(scope, "running", FP)
    parked = await cached_store.reserve(scope, "parked", FP)
    await cached_store.mark_unknown(scope, "parked", parked.token)
    failed = await cached_store.reserve(scope, "failed", FP)
    await cached_store.fail_retryable(scope, "failed", failed.token)
    for _ in range(2):  # decisions read from Postgres, never from the cache
        assert (await cached_store.reserve(scope, "running", FP)).kind is (DecisionKind.IN_PROGRESS)
        assert (await cached_store.reserve(scope, "parked", FP)).kind is DecisionKind.UNKNOWN
    assert await cached_keys(redis_client, redis_prefix) == []
    await cached_store.complete(scope, "running", running.token, "done")
    assert len(await cached_keys(redis_client, redis_prefix)) == 1


async def test_evict_and_prune_remove_cached_entries(
    cached_store: PostgresStore,
    pg_pool: asyncpg.Pool,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    for key in ("evicted", "pruned"):
        d = await cached_store.reserve(scope, key, FP)
        await cached_store.complete(scope, key, d.token, key)
    assert len(await cached_keys(redis_client, redis_prefix)) == 2
    await cached_store.evict(scope, "evicted")
    assert (await cached_store.reserve(scope, "evicted", FP)).kind is DecisionKind.EXECUTE
    await pg_pool.execute(
        f"UPDATE {cached_store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = $1 AND key = 'pruned'",
        scope,
    )
    await cached_store.prune()
    assert await cached_keys(redis_client, redis_prefix) == []
    assert (await cached_store.reserve(scope, "pruned", FP)).kind is DecisionKind.EXECUTE


async def test_a_redis_outage_mid_run_changes_no_outcome(
    cached_store: PostgresStore,
    pg_pool: asyncpg.Pool,
    redis_client: aioredis.Redis,
    scope: str,
) -> None:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS cache_effects (scope text, key text)")

    def effect(key: str) -> Any:
        async def handler(conn: asyncpg.Connection) -> Any:
            await conn.execute("INSERT INTO cache_effects VALUES ($1, $2)", scope, key)
            return key

        return handler

    kinds: list[OutcomeKind] = []
    for round_ in range(3):
        if round_ == 1:  # Redis stops answering (every client paused) in the middle of the run
            await redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        for i in range(40):
            key = f"k{i % 20}"  # every key twice per round
            outcome = await run_transactional(cached_store, scope, key, FP, effect(key))
            kinds.append(outcome.kind)
        await asyncio.sleep(0.1)
    assert kinds.count(OutcomeKind.EXECUTED) == 20
    assert kinds.count(OutcomeKind.REPLAYED) == 100
    effects = await pg_pool.fetchval("SELECT count(*) FROM cache_effects WHERE scope = $1", scope)
    assert effects == 20
    assert cached_store.metrics.count("cache_error") >= 1  # the outage was really felt


class CountingClient:
    """The real client, counting the commands the cache sends."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def execute_command(self, *args: Any) -> Any:
        self.calls.append(str(args[0]).lower())
        return await self.client.execute_command(*args)


@pytest.mark.parametrize("fast_path", [False, True], ids=["redis_py", "fast_path"])
async def test_concurrent_lookups_share_one_round_trip_and_get_their_own_answers(
    fast_path: bool,
    pg_pool: asyncpg.Pool,
    cache_client: aioredis.Redis,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    counting = CountingClient(cache_client)
    cache = CompletedCache(counting, prefix=redis_prefix, fast_path=fast_path)
    store = PostgresStore(pg_pool, cache=cache)
    for i in range(10):
        record = store.completed_record(scope, f"k{i}", f"fp{i}", f'{{"i":{i}}}')
        await cache.put(record)
    counting.calls.clear()
    keys = [f"k{i}" for i in range(20)] + ["k3", "k3"]  # 10 cached, 10 not, a repeat
    found = await asyncio.gather(*(cache.get(scope, k) for k in keys))
    # the first goes at once, the rest gather; the fast path never touches redis-py
    assert counting.calls == ([] if fast_path else ["get", "mget"])
    for key, record in zip(keys, found, strict=True):
        if int(key[1:]) < 10:
            assert record is not None and record.key == key and record.fingerprint == f"fp{key[1:]}"
        else:
            assert record is None
    # Redis stops answering: every waiting lookup falls through (a miss), none hangs
    await redis_client.execute_command("CLIENT", "PAUSE", "1000", "ALL")
    cache.timeout = 0.2
    started = asyncio.get_running_loop().time()
    found = await asyncio.gather(*(cache.get(scope, f"k{i}") for i in range(10)))
    assert found == [None] * 10
    assert asyncio.get_running_loop().time() - started < 0.9
    assert cache.metrics.count("cache_error") == 10
    await asyncio.sleep(1.0)  # the pause is over before the next test talks to Redis
    await cache.aclose()


async def test_an_entry_that_names_another_key_is_a_miss(
    cached_store: PostgresStore, redis_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    """Defence in depth: a cache entry carries its own scope and key, so a value that reaches
    the wrong lookup (a misattributed reply, a hand-copied entry) is never replayed."""
    d = await cached_store.reserve(scope, "paid", FP)
    await cached_store.complete(scope, "paid", d.token, {"charged": 100})
    (name,) = await cached_keys(redis_client, redis_prefix)
    await redis_client.set(name.replace(b"paid", b"unpaid"), await redis_client.get(name))
    decision = await cached_store.reserve(scope, "unpaid", FP)
    assert decision.kind is DecisionKind.EXECUTE  # Postgres decided: the key is new
    assert cached_store.metrics.count("cache_error", scope) == 1
    assert cached_store.metrics.count("cache_hit", scope) == 0
