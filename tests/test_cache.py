"""The Redis completed-record cache in front of the Postgres store, against real Redis and
Postgres: what it caches, how it falls through, and the three guarantees of its keys (a cancelled
lookup is no outage, an evict is final across processes, stores sharing a Redis stay apart)."""

from __future__ import annotations

import asyncio
import sys
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
from consumer_idem.cli.settings import Settings
from consumer_idem.types import Record
from tests.conftest import ROOT_DIR, unique

FP = "v1:jcs:aaa"


@pytest.fixture
async def cache_client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    yield client
    await client.aclose()


@pytest.fixture(params=["socket_timeout", "no_socket_timeout"])
async def cached_store(
    request: pytest.FixtureRequest,
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    cache_client: aioredis.Redis,
    redis_prefix: str,
) -> AsyncIterator[PostgresStore]:
    """redis-py with its socket timeout; redis-py without one (the cache's own ``timeout`` then
    bounds every call, so an outage still falls through instead of hanging). On the session's
    schema, migrated by ``store``."""
    if request.param == "no_socket_timeout":
        client = aioredis.from_url(settings.redis_url)
        yield PostgresStore(pg_pool, cache=CompletedCache(client, prefix=redis_prefix, timeout=0.5))
        await client.aclose()
        return
    yield PostgresStore(pg_pool, cache=CompletedCache(cache_client, prefix=redis_prefix))


def cache_of(store: PostgresStore) -> CompletedCache:
    assert store.cache is not None
    return store.cache


async def cached_keys(redis_client: aioredis.Redis, prefix: str) -> list[bytes]:
    """The cache entries under ``prefix`` (an evict's fences are not entries)."""
    found = [k async for k in redis_client.scan_iter(match=prefix + "*")]
    return [k for k in found if not k.endswith(b":fence")]


async def complete(store: PostgresStore, scope: str, key: str, result: Any) -> None:
    decision = await store.reserve(scope, key, FP)
    assert decision.kind is DecisionKind.EXECUTE
    await store.complete(scope, key, decision.token, result)


async def test_a_duplicate_is_answered_without_postgres(
    pg_dsn: str, cache_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    assert pool is not None
    store = PostgresStore(pool, cache=CompletedCache(cache_client, prefix=redis_prefix))
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
        await complete(cached_store, scope, key, key)
    assert len(await cached_keys(redis_client, redis_prefix)) == 2
    await cached_store.evict(scope, "evicted")
    assert (await cached_store.reserve(scope, "evicted", FP)).kind is DecisionKind.EXECUTE
    await pg_pool.execute(
        f"UPDATE {cached_store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = $1 AND key = 'pruned'",
        scope,
    )
    await cached_store.maintenance.prune()
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


async def test_concurrent_lookups_get_their_own_answers_and_an_outage_fails_them_fast(
    cached_store: PostgresStore, redis_client: aioredis.Redis, scope: str
) -> None:
    cache = cache_of(cached_store)
    for i in range(10):
        await complete(cached_store, scope, f"k{i}", {"i": i})
    keys = [f"k{i}" for i in range(20)] + ["k3", "k3"]  # 10 cached, 10 not, a repeat
    found = await asyncio.gather(*(cache.get(scope, k) for k in keys))
    for key, record in zip(keys, found, strict=True):
        if int(key[1:]) < 10:
            assert record is not None and record.key == key and record.result_json is not None
            assert record.result_json.replace(" ", "") == f'{{"i":{key[1:]}}}'
        else:
            assert record is None
    # Redis stops answering: every waiting lookup falls through (a miss), none hangs
    await redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    started = asyncio.get_running_loop().time()
    found = await asyncio.gather(*(cache.get(scope, f"k{i}") for i in range(10)))
    assert found == [None] * 10
    assert asyncio.get_running_loop().time() - started < 1.2  # bounded by the 0.5 s timeouts
    assert cache.metrics.count("cache_error") == 10
    await asyncio.sleep(1.5)  # the pause is over before the next test talks to Redis


@pytest.mark.parametrize(
    "client_options",
    [{"socket_timeout": 2.0}, {}, {"socket_timeout": None}],
    ids=["longer_socket_timeout", "redis_py_default", "no_socket_timeout"],
)
async def test_a_lookup_is_bounded_by_the_cache_timeout_whatever_the_client_waits(
    client_options: dict[str, float | None],
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    """The cache's ``timeout`` bounds a lookup even when the client would wait longer (its own
    ``socket_timeout``, or redis-py 8's default of 5 s per connection): a hung Redis is an
    outage after ``timeout``, not after the client's timeout. (A client with any socket timeout
    used to be trusted to bound the call alone.)"""
    client = aioredis.from_url(settings.redis_url, **client_options)  # type: ignore[arg-type]
    cache = CompletedCache(client, prefix=redis_prefix, timeout=0.3)
    cached = PostgresStore(pg_pool, cache=cache)
    await complete(cached, scope, "k", 1)
    await redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    started = asyncio.get_running_loop().time()
    assert await cache.get(scope, "k") is None  # a miss: Postgres decides
    assert asyncio.get_running_loop().time() - started < 1.0
    assert cache.metrics.count("cache_error") == 1
    await asyncio.sleep(1.5)  # the pause is over before the next test talks to Redis
    await client.aclose()


async def test_a_fill_after_the_server_lost_its_scripts_still_fills(
    cached_store: PostgresStore, redis_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    """A Redis restart without persistence (or SCRIPT FLUSH) forgets the fill script: the fill
    sends it again instead of failing, and nothing counts as an outage."""
    await redis_client.script_flush()
    await complete(cached_store, scope, "paid", {"charged": 100})
    assert len(await cached_keys(redis_client, redis_prefix)) == 1
    assert cached_store.metrics.count("cache_error") == 0
    assert (await cached_store.reserve(scope, "paid", FP)).kind is DecisionKind.REPLAY
    assert cached_store.metrics.count("cache_hit", scope) == 1


async def test_an_entry_that_names_another_key_is_a_miss(
    cached_store: PostgresStore, redis_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    """Defence in depth: a cache entry carries its own store, scope and key, so a value that
    reaches the wrong lookup (a hand-copied entry) is never replayed."""
    await complete(cached_store, scope, "paid", {"charged": 100})
    (name,) = await cached_keys(redis_client, redis_prefix)
    await redis_client.set(name.replace(b"paid", b"unpaid"), await redis_client.get(name))
    decision = await cached_store.reserve(scope, "unpaid", FP)
    assert decision.kind is DecisionKind.EXECUTE  # Postgres decided: the key is new
    assert cached_store.metrics.count("cache_error", scope) == 1
    assert cached_store.metrics.count("cache_hit", scope) == 0


# --- a cancelled lookup is not an outage ---------------------------------------------------------


@pytest.mark.parametrize("socket_timeout", [2.0, None], ids=["socket_timeout", "cache_timeout"])
async def test_a_cancelled_lookup_changes_no_other_lookup_and_opens_no_breaker(
    socket_timeout: float | None,
    settings: Settings,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    """Lookups in flight together, two of them cancelled: the others get their own records, the
    breaker stays closed (the next lookup still asks Redis) and nothing counts as an error.
    (Batched lookups shared one future: cancelling the lookup that led a batch turned the others
    into misses and failed the lookup in flight, which opened the breaker for 5 s.)"""
    client = aioredis.from_url(settings.redis_url, socket_timeout=socket_timeout)
    cache = CompletedCache(client, prefix=redis_prefix, timeout=2.0)
    cached = PostgresStore(pg_pool, cache=cache)
    for i in range(8):
        await complete(cached, scope, f"k{i}", i)
    # Redis holds its replies for a while, so every lookup below is in flight at once
    await redis_client.execute_command("CLIENT", "PAUSE", "500", "ALL")
    lookups = [asyncio.create_task(cache.get(scope, f"k{i}")) for i in range(8)]
    await asyncio.sleep(0.1)  # all sent, none answered
    assert not any(lookup.done() for lookup in lookups)
    lookups[1].cancel()  # the second lookup led the batch of those sent while one was in flight
    lookups[5].cancel()
    for i, lookup in enumerate(lookups):
        if i in (1, 5):
            with pytest.raises(asyncio.CancelledError):
                await lookup
        else:
            record = await lookup
            assert record is not None and record.key == f"k{i}" and record.result_json == str(i)
    assert cache.metrics.count("cache_error") == 0
    assert cache.metrics.count("cache_hit", scope) == 6
    # the breaker is closed: the very next lookups are answered by Redis, not Postgres
    again = await asyncio.gather(*(cache.get(scope, f"k{i}") for i in (1, 5)))
    assert [r.key if r else None for r in again] == ["k1", "k5"]
    assert (await cached.reserve(scope, "k1", FP)).kind is DecisionKind.REPLAY
    assert cache.metrics.count("cache_hit", scope) == 9
    await client.aclose()


# --- an evict is final ---------------------------------------------------------------------------


class HeldFillCache(CompletedCache):
    """The real cache, whose fills wait until ``release`` is set: the delay between a reader's
    Postgres read and its cache fill, where an evict can slip in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def put(self, record: Record) -> None:
        self.holding.set()
        await self.release.wait()
        await super().put(record)


EVICTOR = """
import asyncio, sys
import asyncpg, redis.asyncio as aioredis
from consumer_idem import CompletedCache, PostgresStore

async def main(dsn, url, prefix, scope, key):
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    redis = aioredis.from_url(url)
    store = PostgresStore(pool, cache=CompletedCache(redis, prefix=prefix))
    print(await store.evict(scope, key))
    await redis.aclose()
    await pool.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("evictor", ["same_store", "other_process"])
async def test_an_evict_racing_a_replay_read_from_postgres_is_not_undone(
    evictor: str,
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    """A reader misses the cache, reads the completed record from Postgres and is held before
    its cache fill; meanwhile the record is evicted (by the same store, or by another process
    sharing Redis). The late fill must not bring the entry back: the next reservation executes.
    (The fill used to write unconditionally: the evicted record was replayed until its TTL.)"""
    await complete(store, scope, "k", "before")  # in Postgres only: the store has no cache
    cache = HeldFillCache(redis_client, prefix=redis_prefix)
    reader = PostgresStore(pg_pool, cache=cache)
    reading = asyncio.create_task(reader.reserve(scope, "k", FP))
    await asyncio.wait_for(cache.holding.wait(), 5)  # Postgres answered: a replay, not yet cached
    if evictor == "same_store":
        assert await reader.evict(scope, "k")
    else:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            EVICTOR,
            pg_dsn,
            settings.redis_url,
            redis_prefix,
            scope,
            "k",
            cwd=ROOT_DIR,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0 and out.strip() == b"True", err.decode()
    cache.release.set()
    assert (await reading).kind is DecisionKind.REPLAY  # what it read before the evict
    fresh = await reader.reserve(scope, "k", FP)
    assert fresh.kind is DecisionKind.EXECUTE  # the evict holds: Postgres decides, the key is new
    assert await cached_keys(redis_client, redis_prefix) == []
    assert reader.metrics.count("cache_fill_fenced", scope) == 1
    # the fence stops only fills that read before it: the new record is cached as usual
    await reader.complete(scope, "k", fresh.token, "after")
    assert len(await cached_keys(redis_client, redis_prefix)) == 1
    replay = await reader.reserve(scope, "k", FP)
    assert replay.kind is DecisionKind.REPLAY and replay.record.result_json == '"after"'
    assert reader.metrics.count("cache_hit", scope) == 1


async def test_a_fill_needs_a_lookup_of_its_key_by_the_same_task(
    cached_store: PostgresStore, redis_client: aioredis.Redis, redis_prefix: str, scope: str
) -> None:
    """A fill is only as safe as the fence read before the Postgres read: a put with no lookup
    of its key in this task (or with one made by another task) fills nothing."""
    cache = cache_of(cached_store)
    await asyncio.create_task(complete(cached_store, scope, "k", 1))  # its tickets stay there
    record = await cached_store.get(scope, "k")
    assert record is not None
    (entry,) = await cached_keys(redis_client, redis_prefix)
    await redis_client.delete(entry)  # as if it had expired
    await cache.put(record)  # no lookup at all
    await asyncio.create_task(cache.get(scope, "k"))  # a lookup, by another task
    await cache.put(record)
    assert await cached_keys(redis_client, redis_prefix) == []
    assert cache.metrics.count("cache_fill_skipped", scope) == 2
    assert await cache.get(scope, "k") is None  # this task's own lookup, then the read
    record = await cached_store.get(scope, "k")
    assert record is not None
    await cache.put(record)  # now the fill lands
    assert await cached_keys(redis_client, redis_prefix) == [entry]
    await redis_client.delete(entry)
    await cache.put(record)  # the ticket was used up
    assert await cached_keys(redis_client, redis_prefix) == []
    assert cache.metrics.count("cache_fill_skipped", scope) == 3


# --- stores sharing one Redis ----------------------------------------------------------------


@pytest.fixture
async def second_schema(pg_pool: asyncpg.Pool) -> AsyncIterator[str]:
    schema = unique("cache").replace("-", "_")
    yield schema
    await pg_pool.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_stores_sharing_one_redis_never_answer_each_others_keys(
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    second_schema: str,
    redis_client: aioredis.Redis,
    redis_prefix: str,
    scope: str,
) -> None:
    """Two stores (two schemas of one database) behind caches with the same prefix on one Redis:
    the same scope and key are two records. (Keys carried no store identity: the second store
    replayed the first one's result for a key it had never seen.)"""
    first = PostgresStore(pg_pool, cache=CompletedCache(redis_client, prefix=redis_prefix))
    second = PostgresStore(
        pg_pool, schema=second_schema, cache=CompletedCache(redis_client, prefix=redis_prefix)
    )
    await second.migrate()
    await complete(first, scope, "k", "first")
    # a delivery of its own (its task's tickets are its own; see the ticket test)
    decision = await asyncio.create_task(second.reserve(scope, "k", FP))
    assert decision.kind is DecisionKind.EXECUTE
    assert second.metrics.count("cache_hit", scope) == 0
    await second.evict(scope, "k", token=decision.token)  # its owner lets it go
    await complete(second, scope, "k", "second")
    for owner, result in ((first, '"first"'), (second, '"second"')):
        replay = await owner.reserve(scope, "k", FP)
        assert replay.kind is DecisionKind.REPLAY and replay.record.result_json == result
        assert owner.metrics.count("cache_hit", scope) == 1  # each from its own entry
    assert len(await cached_keys(redis_client, redis_prefix)) == 2
    with pytest.raises(ValueError, match="another store"):
        PostgresStore(pg_pool, schema=second_schema, cache=first.cache)
