"""The FastStream middleware on Redis stream batch subscribers (``StreamSub(..., batch=True)``),
on a real Redis: one transaction per batch, each member ``XACK``-ed only after its commit or
left pending for the (single-entry) claiming subscriber."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from faststream import AckPolicy
from faststream.redis import BinaryMessageFormatV1, RedisBroker, RedisRouter, StreamSub

from consumer_idem import IdempotencyConfigError, PostgresStore
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotentConnection,
)
from tests._faststream import effects_by_key
from tests._payments import wait_until
from tests.conftest import unique

#: the claiming subscriber takes an entry pending this long (ms): the retry delay
CLAIM_AFTER_MS = 300


@pytest.fixture
async def stream(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A stream of its own (and its ``.dlq``), with group ``workers`` reading from its start;
    deleted after."""
    name = unique("rb")
    await redis_client.xgroup_create(name, "workers", id="0", mkstream=True)
    yield name
    await redis_client.delete(name, f"{name}.dlq")


@pytest.fixture
def redis_url(settings: Settings, redis_client: aioredis.Redis) -> str:
    return settings.redis_url


async def pending(client: aioredis.Redis, stream: str) -> int:
    return int((await client.xpending(stream, "workers"))["pending"])


def batch_app(
    redis_url: str, store: Any, scope: str, stream: str, **options: Any
) -> tuple[RedisBroker, Idempotency, list[list[str]], list[str]]:
    """A batch reader writing one effect per member, and the single-entry claiming subscriber
    of the same group taking back what the reader left pending; a member marked ``poison``
    always fails. Returns the broker, the middleware, the reader's calls (keys per batch) and
    the claimer's runs (keys)."""
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(store, broker=broker, scope=scope, **options)
    router = RedisRouter(middlewares=[idem])
    calls: list[list[str]] = []
    claimed: list[str] = []

    async def write(conn: Any, key: str, body: dict[str, Any]) -> None:
        if body.get("poison"):
            raise ConnectionError("the far side refuses it")
        await conn.execute(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)", scope, key, body["n"]
        )

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", batch=True, max_records=10),
        ack_policy=AckPolicy.MANUAL,
    )
    async def read(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> None:
        calls.append(list(current.keys))
        for key, body in zip(current.keys, bodies, strict=True):
            await write(conn, key, body)

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=CLAIM_AFTER_MS),
        ack_policy=AckPolicy.MANUAL,
    )
    async def claim(
        body: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        claimed.append(current.key)
        await write(conn, current.key, body)

    broker.include_router(router)
    return broker, idem, calls, claimed


async def add(client: aioredis.Redis, stream: str, items: list[tuple[str, dict[str, Any]]]) -> None:
    """Entries as FastStream's publisher writes them, keyed by ``idempotency-key``."""
    for key, body in items:
        data = await BinaryMessageFormatV1.encode(
            message=body, reply_to=None, headers={"idempotency-key": key}, correlation_id="c"
        )
        await client.xadd(stream, {"__data__": data})


async def test_redis_batch_duplicates_in_and_across_batches_run_once(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    broker, idem, calls, claimed = batch_app(redis_url, store, scope, stream, backoff=(0.05, 0.2))
    items = [(f"k{i}", {"n": i}) for i in range(12)]
    items.insert(4, items[0])  # a copy in the same batch of 10
    items += items[1:4]  # copies in the next batch
    await add(redis_client, stream, items)  # 16 entries: batches of 10 and 6
    await broker.start()
    try:

        async def settled() -> bool:
            return idem.stats.processed >= len(items) and await pending(redis_client, stream) == 0

        await wait_until(settled, 30, "every entry settled and acked")
        await add(redis_client, stream, items[:5])  # copies in a later batch

        async def again() -> bool:
            done = idem.stats.processed >= len(items) + 5
            return done and await pending(redis_client, stream) == 0

        await wait_until(again, 30, "the later copies settled and acked")
    finally:
        await broker.stop()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(12)})
    assert max(len(keys) for keys in calls) > 1  # members did run together
    assert claimed == [] and idem.stats.dead_lettered == 0  # nothing was left pending
    assert idem.stats.executed == 12


async def test_redis_batch_poison_member_is_dead_lettered_while_the_others_commit(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    broker, idem, calls, claimed = batch_app(
        redis_url, store, scope, stream, backoff=(0.05, 0.1), max_attempts=50, max_deliveries=3
    )
    items = [(f"k{i}", {"n": i}) for i in range(8)]
    items.insert(3, ("poison", {"n": -1, "poison": True}))
    await add(redis_client, stream, items)
    await broker.start()
    try:

        async def dead_lettered() -> bool:
            return idem.stats.dead_lettered == 1 and await pending(redis_client, stream) == 0

        await wait_until(dead_lettered, 30, "the poison dead-lettered, the rest acked")
        await asyncio.sleep(3 * CLAIM_AFTER_MS / 1000)  # nothing claims it again
    finally:
        await broker.stop()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(8)})
    assert "poison" in calls[0] and len(calls[0]) == 9  # one batch, then its members alone
    # its 2nd and 3rd deliveries, then dead-lettered; the members the batch did not reach
    # after it (the core stops at a retry) were left pending and claimed, each run once
    assert Counter(claimed)["poison"] == 2
    [(_, dead)] = await redis_client.xrange(f"{stream}.dlq")
    body, headers = BinaryMessageFormatV1.parse(dead[b"__data__"])
    assert json.loads(body) == {"n": -1, "poison": True}
    assert headers["x-dead-letter-reason"] == "max_deliveries_exceeded"
    assert "the far side refuses it" in headers["x-dead-letter-error"]
    assert headers["x-dead-letter-deliveries"] == "3"
    assert headers["x-dead-letter-key"] == "poison"
    assert headers["x-original-queue"] == stream


async def test_redis_batch_postgres_outage_leaves_every_member_pending_then_resumes(
    redis_url: str,
    redis_client: aioredis.Redis,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    from tests._broker import Outage

    outage = await Outage.start(store, pg_dsn)
    broker, idem, _, _ = batch_app(
        redis_url, outage.down, scope, stream, backoff=(0.05, 0.2), max_deliveries=2
    )
    await add(redis_client, stream, [(f"k{i}", {"n": i}) for i in range(10)])
    await broker.start()
    try:
        await asyncio.sleep(2.5)  # many more deliveries than max_deliveries=2 meanwhile
        assert idem.stats.dead_lettered == 0 and idem.stats.processed == 0
        assert await pending(redis_client, stream) == 10  # delivered, none acked
        outage.end()

        async def all_acked() -> bool:
            return idem.stats.processed >= 10 and await pending(redis_client, stream) == 0

        await wait_until(all_acked, 30, "every member to run once the store is back")
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 0
    assert not await redis_client.exists(f"{stream}.dlq")
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(10)})


async def test_redis_batch_reader_with_a_claiming_subscriber_is_accepted_at_start(
    redis_url: str, store: PostgresStore, scope: str, stream: str
) -> None:
    """``StreamSub(..., batch=True)`` reading new entries, with a claiming subscriber of its
    group through the same middleware: the broker starts (it was refused before)."""
    broker, _, _, _ = batch_app(redis_url, store, scope, stream)
    await broker.start()
    try:
        assert all(sub.running for sub in broker.subscribers)
    finally:
        await broker.stop()


async def test_redis_claiming_batch_subscriber_is_refused_at_start(
    redis_url: str, store: PostgresStore, scope: str, stream: str
) -> None:
    """A claimed entry may be what killed the last consumer: it must run alone, counted."""
    broker = RedisBroker(redis_url, logger=None)
    router = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", batch=True, min_idle_time=1000),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(bodies: list[dict[str, Any]]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=r"claiming subscriber .* batch=True"):
        await broker.start()
    await broker.stop()


async def test_redis_batch_reader_without_a_claiming_subscriber_is_refused_at_start(
    redis_url: str, store: PostgresStore, scope: str, stream: str
) -> None:
    broker = RedisBroker(redis_url, logger=None)
    router = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", batch=True, max_records=10),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(bodies: list[dict[str, Any]]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=r"nothing claims"):
        await broker.start()
    await broker.stop()


async def test_redis_batch_entry_killing_the_consumer_is_dead_lettered_after_max_deliveries(
    redis_url: str,
    redis_client: aioredis.Redis,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    """A batch member whose handler SIGKILLs the process never fails: the whole batch stays
    pending, the single-entry claimer takes each entry back alone, counted in Postgres, and the
    killer is dead-lettered after ``max_deliveries`` counted runs; the others run once."""
    from tests.test_faststream_redis import start_pod

    await add(redis_client, stream, [("poison", {"n": 0, "kill": True})])
    await add(redis_client, stream, [(f"k{n}", {"n": n}) for n in range(1, 4)])
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    kills = 0
    proc = None
    try:
        for pod in range(5):  # max_deliveries=2: the batch, 2 counted runs, the dead letter
            proc = await start_pod(redis_url, stream, f"pod-{pod}", scope, env, "2", "batch")
            try:
                await asyncio.wait_for(proc.wait(), timeout=8)  # claimed after 0.8 s idle
            except TimeoutError:
                break  # alive: the poison was dead-lettered
            assert proc.returncode == -signal.SIGKILL
            kills += 1

        async def settled() -> bool:
            done = sum((await effects_by_key(pg_pool, scope)).values()) == 3
            return done and await pending(redis_client, stream) == 0

        await wait_until(settled, 20, "the poison dead-lettered and the rest run")
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    assert kills == 3  # the batch's run (uncounted), then max_deliveries counted runs
    [(_, dead)] = await redis_client.xrange(f"{stream}.dlq")
    body, headers = BinaryMessageFormatV1.parse(dead[b"__data__"])
    assert json.loads(body) == {"n": 0, "kill": True}
    assert headers["x-dead-letter-reason"] == "max_deliveries"
    assert headers["x-dead-letter-key"] == "poison"
    assert await effects_by_key(pg_pool, scope) == Counter({"k1": 1, "k2": 1, "k3": 1})


async def test_redis_batch_waits_while_a_claimed_entry_runs_alone(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    """A claimed entry (delivered before: maybe what killed the last consumer) runs alone in
    its process: a batch of new entries read meanwhile waits for it, so a crash it causes takes
    no batch with it."""
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.2))
    router = RedisRouter(middlewares=[idem])
    claimed_running = asyncio.Event()
    beside: list[bool] = []  # per batch call: did it run while the claimed entry ran?

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", batch=True, max_records=10),
        ack_policy=AckPolicy.MANUAL,
    )
    async def read(bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch) -> None:
        if any(body.get("slow") for body in bodies):
            raise ConnectionError("fails on its first delivery: left pending, then claimed")
        beside.append(claimed_running.is_set())

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=CLAIM_AFTER_MS),
        ack_policy=AckPolicy.MANUAL,
    )
    async def claim(body: dict[str, Any]) -> None:
        claimed_running.set()
        await asyncio.sleep(1.5)
        claimed_running.clear()

    broker.include_router(router)
    await broker.start()
    try:
        await add(redis_client, stream, [("slow", {"n": 0, "slow": True})])
        await asyncio.wait_for(claimed_running.wait(), 10)
        await add(redis_client, stream, [(f"k{n}", {"n": n}) for n in range(1, 6)])

        async def settled() -> bool:
            return idem.stats.processed >= 6 and await pending(redis_client, stream) == 0

        await wait_until(settled, 20, "the claimed entry and the batch settled")
    finally:
        await broker.stop()
    assert beside and not any(beside)


async def test_redis_batch_members_failed_run_counts_toward_max_deliveries(
    redis_url: str,
    redis_client: aioredis.Redis,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    """A member's failed run in a batch (a first delivery) counts one attempt of its key, as a
    single entry's does: after it, the claimed entry that kills the process runs only until
    ``max_deliveries`` attempts in all, then is dead-lettered."""
    from tests.test_faststream_redis import start_pod

    await add(redis_client, stream, [("poison", {"n": 0, "kill": True, "fail_in_batch": True})])
    await add(redis_client, stream, [(f"k{n}", {"n": n}) for n in range(1, 4)])
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    kills = 0
    proc = None
    try:
        for pod in range(5):
            proc = await start_pod(redis_url, stream, f"pod-{pod}", scope, env, "2", "batch")
            try:
                await asyncio.wait_for(proc.wait(), timeout=8)
            except TimeoutError:
                break  # alive: the poison was dead-lettered
            assert proc.returncode == -signal.SIGKILL
            kills += 1

        async def settled() -> bool:
            done = sum((await effects_by_key(pg_pool, scope)).values()) == 3
            return done and await pending(redis_client, stream) == 0

        await wait_until(settled, 20, "the poison dead-lettered and the rest run")
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    assert kills == 1  # the batch's failed run (counted), then one counted run that kills
    [(_, dead)] = await redis_client.xrange(f"{stream}.dlq")
    assert BinaryMessageFormatV1.parse(dead[b"__data__"])[1]["x-dead-letter-key"] == "poison"
    assert await effects_by_key(pg_pool, scope) == Counter({"k1": 1, "k2": 1, "k3": 1})
