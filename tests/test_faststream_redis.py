"""The FastStream middleware on a real Redis, streams read through consumer groups:
duplicates, poison after ``max_deliveries``, a Postgres outage, SIGKILLed consumers whose
pending entries are claimed, and the subscribers refused at start-up."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from faststream import AckPolicy
from faststream.redis import (
    BinaryMessageFormatV1,
    ListSub,
    RedisBroker,
    RedisRouter,
    StreamSub,
    TestRedisBroker,
)

from consumer_idem import IdempotencyConfigError, PostgresStore
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotentConnection,
    IdempotentOutbox,
)
from tests._faststream import effect_count, write_effect
from tests._outbox import outbox_store, rows, sent_keys
from tests._payments import wait_until
from tests.conftest import unique

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the claiming subscriber takes an entry pending this long (ms): the retry delay
CLAIM_AFTER_MS = 300


@pytest.fixture
async def stream(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A stream of its own (and its ``.dlq`` and ``.out`` streams), deleted after."""
    name = unique("fsr")
    yield name
    await redis_client.delete(name, f"{name}.dlq", f"{name}.out")


@pytest.fixture
def redis_url(settings: Settings, redis_client: aioredis.Redis) -> str:
    return settings.redis_url


def idempotent_stream(
    router: RedisRouter, stream: str, claim_after: int = CLAIM_AFTER_MS
) -> Callable[[Any], Any]:
    """The reading and the claiming subscriber of group ``workers`` on one handler."""

    def decorate(handler: Any) -> Any:
        reading = router.subscriber(
            stream=StreamSub(stream, group="workers", consumer="w1", max_records=10),
            ack_policy=AckPolicy.MANUAL,
        )
        claiming = router.subscriber(
            stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=claim_after),
            ack_policy=AckPolicy.MANUAL,
        )
        return reading(claiming(handler))

    return decorate


async def pending(client: aioredis.Redis, stream: str, group: str = "workers") -> int:
    """Entries of ``group`` delivered and not yet acked (the pending-entries list)."""
    return int((await client.xpending(stream, group))["pending"])


async def test_redis_duplicates_run_once_and_every_entry_is_acked(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.5))
    router = RedisRouter(middlewares=[idem])

    @idempotent_stream(router, stream)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:
        # each key twice, as a producer retrying an XADD whose reply it lost writes it
        for n in range(10):
            for _ in range(2):
                await broker.publish({"n": n}, stream=stream, headers={"idempotency-key": f"k{n}"})
        await broker.publish({"n": 99}, stream=stream, headers={"message_id": "only-id"})

        async def all_settled() -> bool:
            return idem.stats.processed >= 21

        await wait_until(all_settled, 30, "every delivery to be settled")
    finally:
        await broker.stop()
    assert await effect_count(pg_pool, scope) == 11
    assert idem.stats.executed == 11 and idem.stats.dead_lettered == 0
    assert await store.get(scope, "only-id") is not None  # keyed by the publisher's message_id
    assert await pending(redis_client, stream) == 0  # every entry XACKed


async def test_redis_poison_is_dead_lettered_after_max_deliveries_with_its_reason(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(
        store, broker=broker, scope=scope, backoff=(0.05, 0.1), max_attempts=50, max_deliveries=3
    )
    router = RedisRouter(middlewares=[idem])
    runs: list[int] = []

    @idempotent_stream(router, stream)
    async def handle(data: dict[str, Any]) -> None:
        runs.append(data["n"])
        raise ConnectionError("the far side refuses it")

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, stream=stream, headers={"idempotency-key": "poison"})

        async def dead_lettered() -> bool:
            return idem.stats.dead_lettered >= 1

        await wait_until(dead_lettered, 30, "the poison message to be dead-lettered")
        await asyncio.sleep(3 * CLAIM_AFTER_MS / 1000)  # nothing claims it again
    finally:
        await broker.stop()
    assert runs == [1, 1, 1]  # one run per delivery (read, then claimed twice), none after
    dead = await redis_client.xrange(f"{stream}.dlq")
    assert len(dead) == 1
    headers, body = _decoded(dead[0][1])
    assert json.loads(body) == {"n": 1}
    assert headers["x-dead-letter-reason"] == "max_deliveries_exceeded"
    assert "the far side refuses it" in headers["x-dead-letter-error"]
    assert headers["x-dead-letter-deliveries"] == "3"
    assert headers["x-dead-letter-key"] == "poison"
    assert headers["x-original-queue"] == stream
    assert await pending(redis_client, stream) == 0  # the original acked after the copy


def _decoded(fields: dict[bytes, bytes]) -> tuple[dict[str, Any], bytes]:
    """Headers and body of an entry FastStream wrote (its binary message format)."""
    body, headers = BinaryMessageFormatV1.parse(fields[b"__data__"])
    return headers, body


async def test_redis_postgres_outage_holds_entries_pending_and_spends_no_delivery(
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
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(
        outage.down, broker=broker, scope=scope, backoff=(0.05, 0.2), max_deliveries=2
    )
    router = RedisRouter(middlewares=[idem])
    runs: list[int] = []

    @idempotent_stream(router, stream)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(data["n"])
        if len(runs) == 1:  # the first real run fails once: one of its two deliveries spent
            raise ConnectionError("the gateway hiccups once")
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, stream=stream, headers={"idempotency-key": "k1"})
        await asyncio.sleep(2.5)  # many more deliveries than max_deliveries=2 meanwhile
        assert idem.stats.retries >= 4 and idem.stats.dead_lettered == 0
        assert await pending(redis_client, stream) == 1  # delivered, unacked
        outage.end()

        async def ran() -> bool:
            return idem.stats.processed >= 1

        await wait_until(ran, 15, "the entry to run once the store is back")
    finally:
        await broker.stop()
    # the deliveries that waited for the store spent nothing: one failure, then the effect
    assert runs == [1, 1] and idem.stats.dead_lettered == 0 and idem.stats.executed == 1
    assert await effect_count(pg_pool, scope) == 1
    assert await pending(redis_client, stream) == 0
    assert not await redis_client.exists(f"{stream}.dlq")


async def start_pod(
    redis_url: str, stream: str, consumer: str, scope: str, env: dict[str, str], *more: str
) -> asyncio.subprocess.Process:
    """A consumer process of group ``workers`` (`tests._redis_chaos_child`); ``more``: its
    optional arguments (``max_deliveries``)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._redis_chaos_child",
        redis_url,
        stream,
        "workers",
        consumer,
        scope,
        *more,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def test_redis_sigkilled_consumers_entries_are_claimed_and_run_exactly_once(
    redis_url: str,
    redis_client: aioredis.Redis,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    """Consumers SIGKILLed mid-run, five times, each replaced by one of another name (a new
    pod): what each left pending is claimed and settled through the store, nothing lost, no
    effect twice."""
    await redis_client.xgroup_create(stream, "workers", id="0", mkstream=True)
    keys = [f"k{n}" for n in range(300)]
    for n, key in enumerate(keys):
        copies = 2 if n % 10 == 0 else 1  # a producer's retried XADD: the same key again
        for _ in range(copies):
            await redis_client.xadd(
                stream, {"__data__": await _encoded({"n": n}, {"idempotency-key": key})}
            )
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    rng = random.Random(38)
    kills = 0
    try:
        for round_ in range(6):
            proc = await start_pod(redis_url, stream, f"pod-{round_}", scope, env)
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
            assert json.loads(line)["event"] == "started", line
            if round_ == 5:
                break  # the last one drains what is left
            await asyncio.sleep(rng.uniform(0.3, 0.9))
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            kills += 1

        async def drained() -> bool:
            done = await effect_count(pg_pool, scope) == len(keys)
            return done and await pending(redis_client, stream) == 0

        await wait_until(drained, 30, "every entry run and acked")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    assert kills == 5
    per_key = await pg_pool.fetch(
        "SELECT key, count(*) AS runs FROM fs_effects WHERE scope = $1 GROUP BY key", scope
    )
    assert {r["key"] for r in per_key} == set(keys)  # none lost
    assert {r["runs"] for r in per_key} == {1}  # none twice
    info = await redis_client.xinfo_groups(stream)
    assert info[0]["pending"] == 0 and info[0]["lag"] == 0


async def test_redis_entry_killing_the_consumer_is_dead_lettered_after_max_deliveries(
    redis_url: str,
    redis_client: aioredis.Redis,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    """An entry whose handler SIGKILLs the process never fails, so no failure count ends its
    loop: the claiming subscriber hands it over as delivered before, and it runs counted in
    Postgres ahead of its handler until ``max_deliveries`` runs, then goes to the dead-letter
    stream. The entries around it run once."""
    await redis_client.xgroup_create(stream, "workers", id="0", mkstream=True)
    poison = await _encoded({"n": 0, "kill": True}, {"idempotency-key": "poison"})
    await redis_client.xadd(stream, {"__data__": poison})
    for n in range(1, 4):
        await redis_client.xadd(
            stream, {"__data__": await _encoded({"n": n}, {"idempotency-key": f"k{n}"})}
        )
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    kills = 0
    proc = None
    try:
        for pod in range(5):  # max_deliveries=2: the first run, 2 counted runs, the dead letter
            proc = await start_pod(redis_url, stream, f"pod-{pod}", scope, env, "2")
            try:
                await asyncio.wait_for(proc.wait(), timeout=8)  # claimed after 0.8 s idle
            except TimeoutError:
                break  # alive: the poison was dead-lettered
            assert proc.returncode == -signal.SIGKILL
            kills += 1

        async def settled() -> bool:
            done = await effect_count(pg_pool, scope) == 3
            return done and await pending(redis_client, stream) == 0

        await wait_until(settled, 20, "the poison dead-lettered and the rest run")
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    assert kills == 3  # the first run (uncounted), then max_deliveries counted runs
    [(_, dead)] = await redis_client.xrange(f"{stream}.dlq")
    headers, body = _decoded(dead)
    assert json.loads(body) == {"n": 0, "kill": True}
    assert headers["x-dead-letter-reason"] == "max_deliveries"
    assert headers["x-dead-letter-key"] == "poison"
    per_key = await pg_pool.fetch(
        "SELECT key, count(*) AS runs FROM fs_effects WHERE scope = $1 GROUP BY key", scope
    )
    assert {r["key"]: r["runs"] for r in per_key} == {"k1": 1, "k2": 1, "k3": 1}


async def _encoded(body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """An entry as FastStream's publisher writes it (its binary message format)."""
    return await BinaryMessageFormatV1.encode(
        message=body, reply_to=None, headers=headers, correlation_id="c"
    )


@pytest.mark.parametrize(
    ("subscribe", "refusal"),
    [
        ({"list": ListSub("LIST")}, r"Redis list subscriber"),
        ({"channel": "LIST"}, r"Redis pub/sub subscriber"),
        ({"stream": StreamSub("LIST")}, r"without a consumer group"),
        (
            {"stream": StreamSub("LIST", group="workers", consumer="w1", no_ack=True)},
            r"no_ack=True",
        ),
        ({"stream": StreamSub("LIST", group="workers", consumer="w1")}, r"nothing claims"),
    ],
    ids=["list", "pubsub", "no_group", "no_ack", "no_claimer"],
)
async def test_redis_subscriber_that_cannot_redeliver_is_refused_at_start(
    redis_url: str,
    store: PostgresStore,
    scope: str,
    stream: str,
    subscribe: dict[str, Any],
    refusal: str,
) -> None:
    broker = RedisBroker(redis_url, logger=None)
    router = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])
    options = {name: _renamed(value, stream) for name, value in subscribe.items()}
    if "stream" in options:
        options["ack_policy"] = AckPolicy.MANUAL  # (lists and pub/sub have no other)

    @router.subscriber(**options)
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=refusal):
        await broker.start()
    await broker.stop()


def _renamed(value: Any, stream: str) -> Any:
    """The test's own stream (or list, or channel) in place of the placeholder ``LIST``."""
    if isinstance(value, str):
        return stream
    value.name = stream
    return value


@pytest.mark.parametrize(
    "policy", [None, AckPolicy.ACK_FIRST, AckPolicy.ACK, AckPolicy.NACK_ON_ERROR]
)
async def test_redis_ack_policy_settling_before_the_middleware_is_refused_at_start(
    redis_url: str, store: PostgresStore, scope: str, stream: str, policy: AckPolicy | None
) -> None:
    broker = RedisBroker(redis_url, logger=None)
    router = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])
    options = {} if policy is None else {"ack_policy": policy}  # None: FastStream's default

    @router.subscriber(stream=StreamSub(stream, group="workers", consumer="w1"), **options)
    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=1000),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=r"ack_policy=AckPolicy\."):
        await broker.start()
    await broker.stop()


async def test_redis_outbox_publishes_to_a_stream_once_per_committed_run(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    scope: str,
    stream: str,
) -> None:
    outbox = outbox_store(pg_pool, relay_after=60)
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(outbox, broker=broker, scope=scope, backoff=(0.05, 0.2))
    router = RedisRouter(middlewares=[idem])
    failed: set[str] = set()

    @idempotent_stream(router, stream)
    async def book(
        data: dict[str, Any], outbox: IdempotentOutbox, current: CurrentIdempotency
    ) -> None:
        outbox.publish(f"{stream}.out", {"booked": data["n"]})
        if data.get("fail_once") and current.key not in failed:
            failed.add(current.key)  # rolled back with its entry; the claimed retry publishes
            raise ConnectionError("first attempt fails")

    broker.include_router(router)
    await broker.start()
    try:
        for n, key, fail in ((1, "m1", False), (2, "m2", True), (1, "m1", False)):
            await broker.publish(
                {"n": n, "fail_once": fail}, stream=stream, headers={"idempotency-key": key}
            )

        async def sent() -> bool:
            found = await rows(outbox, scope)
            return idem.stats.processed >= 3 and {r["status"] for r in found} == {"sent"}

        await wait_until(sent, 30, "every entry settled and the outbox dispatched")
    finally:
        await broker.stop()
    out = [_decoded(fields) for _, fields in await redis_client.xrange(f"{stream}.out")]
    assert sorted(json.loads(body)["booked"] for _, body in out) == [1, 2]
    keys = await sent_keys(outbox, scope)
    assert {headers["idempotency-key"] for headers, _ in out} == {keys[k] for k in ("m1", "m2")}
    assert await pending(redis_client, stream) == 0


async def test_redis_dead_consumers_pending_entries_are_claimed_and_settled_through_the_store(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    """Entries a consumer read and never acked (it died) are claimed by a live one: the one
    whose key already completed is acked without running, the other runs once."""
    await redis_client.xgroup_create(stream, "workers", id="0", mkstream=True)
    runs: list[str] = []

    async def consume(until: int) -> None:
        broker = RedisBroker(redis_url, logger=None)
        idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.2))
        router = RedisRouter(middlewares=[idem])

        @idempotent_stream(router, stream)
        async def handle(
            data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
        ) -> None:
            runs.append(current.key)
            await write_effect(conn, current, data["n"])

        broker.include_router(router)
        await broker.start()
        try:

            async def settled() -> bool:
                return idem.stats.processed >= until

            await wait_until(settled, 20, f"{until} entries settled")
        finally:
            await broker.stop()

    await redis_client.xadd(stream, {"__data__": await _encoded({"n": 0}, {"message_id": "done"})})
    await consume(1)  # "done" completed and acked
    for n, key in ((1, "done"), (2, "fresh")):  # a copy of it, and a new one
        await redis_client.xadd(stream, {"__data__": await _encoded({"n": n}, {"message_id": key})})
    # a consumer reads both and dies before acking either
    await redis_client.xreadgroup("workers", "dead-pod", {stream: ">"}, count=2)
    owners = await redis_client.xpending_range(stream, "workers", "-", "+", 10)
    assert [o["consumer"] for o in owners] == [b"dead-pod", b"dead-pod"]
    await consume(2)  # claimed after CLAIM_AFTER_MS, settled through the store
    assert runs == ["done", "fresh"]  # the copy of "done" never ran
    assert await effect_count(pg_pool, scope) == 2
    assert await pending(redis_client, stream) == 0


async def test_redis_under_the_test_broker_duplicates_run_once(
    store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    """FastStream's in-memory TestRedisBroker (no Redis, nothing pending to count) with the
    real store: a user's unit test of the subscriber pair."""
    broker = RedisBroker()
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.01, 0.05))
    router = RedisRouter(middlewares=[idem])
    runs: list[str] = []

    @idempotent_stream(router, "payments")
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(current.key)
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    async with TestRedisBroker(broker) as test:
        for _ in range(3):
            await test.publish({"n": 1}, stream="payments", headers={"idempotency-key": "k1"})
    assert runs == ["k1"]
    assert await effect_count(pg_pool, scope) == 1


async def test_redis_claiming_subscriber_under_another_scope_is_refused_at_start(
    redis_url: str, store: PostgresStore, scope: str, stream: str
) -> None:
    """An entry committed under the reader's scope, claimed under another, would run again."""
    broker = RedisBroker(redis_url, logger=None)
    reading = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])
    claiming = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=f"{scope}.b")])

    @reading.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1"), ack_policy=AckPolicy.MANUAL
    )
    @claiming.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=1000),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_routers(reading, claiming)
    with pytest.raises(IdempotencyConfigError, match=r"nothing claims .* through a middleware"):
        await broker.start()
    await broker.stop()


async def test_redis_reading_subscriber_without_max_records_is_warned_about(
    redis_url: str,
    store: PostgresStore,
    scope: str,
    stream: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reading every new entry at once makes those at the back wait past ``min_idle_time``."""
    broker = RedisBroker(redis_url, logger=None)
    router = RedisRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1"), ack_policy=AckPolicy.MANUAL
    )
    @router.subscriber(
        stream=StreamSub(stream, group="workers", consumer="w1", min_idle_time=1000),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with caplog.at_level("WARNING", logger="consumer_idem.faststream"):
        await broker.start()
    await broker.stop()
    warned = [r.getMessage() for r in caplog.records if "max_records" in r.getMessage()]
    assert len(warned) == 1 and repr(stream) in warned[0]
