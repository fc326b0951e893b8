"""Against the peer: ``RedisStore`` and AWS Lambda Powertools' Redis idempotency layer, side by
side on the same Redis, in one run.

Each call handles a payload ``{"id": <new UUID>, "amount": 100}`` keyed by its ``id``:

* Powertools 3.37.0: ``@idempotent_function`` with ``CachePersistenceLayer`` over a
  ``redis.Redis`` client, ``event_key_jmespath="id"``, no local cache and no payload validation
  (its validation is broken there). Synchronous: one thread (c1), or 8 threads (c8).
* ours: ``run_two_phase`` over ``RedisStore`` (redis-py's asyncio client), the key from ``id``
  and the fingerprint of the whole payload (``fingerprint_json``: what makes a reused key with
  another payload a misuse, which Powertools does not check here). One task (c1), or 8 (c8).

First executions use new ids; duplicates call again with ids done before. Chunks of the two
alternate (the machine's speed drifts); each figure is the median chunk rate. Powertools is a
benchmark-only dependency (``pip install -e '.[bench]'``); without it this module reports
nothing and says so.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
import redis.asyncio as aioredis

from benchmarks.common import entry, interleaved
from consumer_idem import Attempt, RedisStore, run_two_phase
from consumer_idem.cli.settings import load_settings
from consumer_idem.fingerprint import fingerprint_json

CONCURRENCY = 8


def powertools_handler(url: str, prefix: str) -> Callable[..., Any] | None:
    try:
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )
    except ImportError:
        return None
    with warnings.catch_warnings():  # its Redis layer warns about its own deprecations
        warnings.simplefilter("ignore")
        layer = CachePersistenceLayer(client=redis.Redis.from_url(url))
    config = IdempotencyConfig(event_key_jmespath="id", use_local_cache=False)

    @idempotent_function(
        data_keyword_argument="order", persistence_store=layer, config=config, key_prefix=prefix
    )
    def handle(order: dict[str, Any]) -> dict[str, Any]:
        return {"ok": order["id"]}

    return handle


async def action(attempt: Attempt) -> dict[str, Any]:
    return {"ok": attempt.key}


async def ours(store: RedisStore, ids: list[str], concurrency: int) -> float:
    per = len(ids) // concurrency

    async def worker(t: int) -> None:
        for i in ids[t * per : (t + 1) * per]:
            payload = {"id": i, "amount": 100}
            await run_two_phase(store, "bench.peer", i, fingerprint_json(payload), action)

    started = time.perf_counter()
    await asyncio.gather(*(worker(t) for t in range(concurrency)))
    return per * concurrency / (time.perf_counter() - started)


def theirs(handle: Callable[..., Any], ids: list[str], concurrency: int) -> float:
    per = len(ids) // concurrency

    def worker(t: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in ids[t * per : (t + 1) * per]:
                handle(order={"id": i, "amount": 100})

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    return per * concurrency / (time.perf_counter() - started)


async def run(per_chunk: int = 1000, chunks: int = 12) -> list[dict[str, Any]]:
    url = load_settings().redis_url
    prefix = f"bench-peer-{uuid.uuid4().hex[:8]}"
    handle = powertools_handler(url, prefix)
    if handle is None:
        print("   aws-lambda-powertools is not installed (pip install -e '.[bench]'): skipped")
        return []
    client = aioredis.from_url(url)
    store = RedisStore(client, prefix=prefix + ":ours:")
    results: list[dict[str, Any]] = []
    done_ours: list[list[str]] = []
    done_theirs: list[list[str]] = []
    try:
        for concurrency in (1, CONCURRENCY):
            n = per_chunk * (2 if concurrency > 1 else 1)

            async def first_theirs(r: int, n: int = n, c: int = concurrency) -> float:
                ids = [str(uuid.uuid4()) for _ in range(n)]
                done_theirs.append(ids)
                return await asyncio.to_thread(theirs, handle, ids, c)

            async def first_ours(r: int, n: int = n, c: int = concurrency) -> float:
                ids = [str(uuid.uuid4()) for _ in range(n)]
                done_ours.append(ids)
                return await ours(store, ids, c)

            async def again_theirs(r: int, c: int = concurrency) -> float:
                return await asyncio.to_thread(theirs, handle, done_theirs[r], c)

            async def again_ours(r: int, c: int = concurrency) -> float:
                return await ours(store, done_ours[r], c)

            done_ours.clear()
            done_theirs.clear()
            await first_theirs(-1)  # warm-up: connections, scripts, imports
            await first_ours(-1)
            done_ours.clear()
            done_theirs.clear()
            base, subject = await interleaved(chunks, first_theirs, first_ours)
            results.append(
                entry(f"redis.store.first.vs_powertools.c{concurrency}", subject, "ops/s", base)
            )
            base, subject = await interleaved(chunks, again_theirs, again_ours)
            results.append(
                entry(f"redis.store.duplicate.vs_powertools.c{concurrency}", subject, "ops/s", base)
            )
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        for i in range(0, len(keys), 1000):
            await client.delete(*keys[i : i + 1000])
        await client.aclose()
    return results
