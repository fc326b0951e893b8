"""Adversarial cases of the FastStream middleware on a real Redis and NATS: what a reviewer
tried to break (a lost message, a doubled effect, a loop with no end), each kept as a test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from faststream import AckPolicy
from faststream.nats import NatsBroker, NatsRouter
from faststream.redis import RedisBroker, RedisRouter, StreamSub

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection
from tests._faststream import effect_count, write_effect
from tests._payments import wait_until
from tests.conftest import unique
from tests.test_faststream_nats import pending as nats_pending
from tests.test_faststream_nats import stream_of
from tests.test_faststream_redis import CLAIM_AFTER_MS, _encoded, idempotent_stream, pending


@pytest.fixture
async def stream(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A stream of its own (and its ``.dlq`` stream), deleted after."""
    name = unique("fsrev")
    yield name
    await redis_client.delete(name, f"{name}.dlq")


@pytest.fixture
async def subject(nats_url: str) -> AsyncIterator[str]:
    """A NATS subject in a JetStream stream of its own, deleted after."""
    import nats

    name = unique("fsrev")
    yield name
    client = await nats.connect(nats_url)
    try:
        await client.jsm().delete_stream(name)
    except Exception:  # never created
        pass
    finally:
        await client.close()


@pytest.fixture
def redis_url(settings: Settings, redis_client: aioredis.Redis) -> str:
    return settings.redis_url


async def test_redis_entry_faststream_cannot_parse_is_dead_lettered_not_claimed_forever(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    """An entry without FastStream's ``__data__`` field whose fields are not UTF-8 makes
    FastStream's parser raise before the handler call: it is dead-lettered (reason
    ``unparseable``, its fields kept byte for byte) and acked, instead of being claimed
    again every ``min_idle_time`` for ever; the entry behind it runs once."""
    await redis_client.xgroup_create(stream, "workers", id="0", mkstream=True)
    bad = await redis_client.xadd(stream, {b"x": b"\xff\xfe"})
    good = await _encoded({"n": 1}, {"idempotency-key": "k1"})
    await redis_client.xadd(stream, {"__data__": good})
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.1), max_deliveries=3)
    router = RedisRouter(middlewares=[idem])

    @idempotent_stream(router, stream)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:

        async def settled() -> bool:
            return await pending(redis_client, stream) == 0 and idem.stats.executed == 1

        await wait_until(settled, 10, "the bad entry dead-lettered, the good one run")
        await asyncio.sleep(3 * CLAIM_AFTER_MS / 1000)  # nothing pending is claimed again
        assert await pending(redis_client, stream) == 0
    finally:
        await broker.stop()
    assert await effect_count(pg_pool, scope) == 1
    [(_, dead)] = await redis_client.xrange(f"{stream}.dlq")
    assert dead[b"x"] == b"\xff\xfe"  # the entry's own fields, byte for byte
    assert dead[b"x-dead-letter-reason"] == b"unparseable"
    assert b"UnicodeDecodeError" in dead[b"x-dead-letter-error"]
    assert dead[b"x-original-queue"] == stream.encode()
    assert dead[b"x-original-entry-id"] == bad
    assert idem.stats.dead_lettered == 1


async def test_redis_lock_wait_on_the_claim_spends_no_delivery_budget(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    pg_dsn: str,
    effects: None,
    stream: str,
) -> None:
    """A deployment whose role has a ``lock_timeout`` (common), while a maintenance statement
    holds the records table (an index built without CONCURRENTLY, a migration): every claim
    of the entry runs out of lock time and waits, the handler never starting. Each claimed
    redelivery counted an attempt ahead of its handler and kept it, so after
    ``max_deliveries`` waits the healthy entry was dead-lettered (``max_deliveries``) without
    having run once. A counted run that only waited now gives its attempt back: the entry
    runs once when the lock goes."""
    impatient = await asyncpg.create_pool(
        pg_dsn, min_size=1, max_size=4, server_settings={"lock_timeout": "200"}
    )
    assert impatient is not None
    broker = RedisBroker(redis_url, logger=None)
    idem = Idempotency(
        PostgresStore(impatient, schema=store.schema),
        broker=broker,
        scope=scope,
        backoff=(0.05, 0.1),
        max_deliveries=2,
    )
    router = RedisRouter(middlewares=[idem])
    runs: list[int] = []

    @idempotent_stream(router, stream)
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(data["n"])
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:
        async with pg_pool.acquire() as locker, locker.transaction():
            await locker.execute(f"LOCK TABLE {store.table} IN ACCESS EXCLUSIVE MODE")
            await broker.publish({"n": 1}, stream=stream, headers={"idempotency-key": "k1"})
            await asyncio.sleep(3)
            [entry] = await redis_client.xpending_range(stream, "workers", "-", "+", 5)
            assert entry["times_delivered"] > 3  # claimed again and again, well past 2
            assert runs == [] and idem.stats.dead_lettered == 0

        async def settled() -> bool:
            return await pending(redis_client, stream) == 0

        await wait_until(settled, 15, "the entry run once the lock is gone")
    finally:
        await broker.stop()
        await impatient.close()
    assert runs == [1] and idem.stats.dead_lettered == 0 and idem.stats.executed == 1
    assert await effect_count(pg_pool, scope) == 1
    assert not await redis_client.exists(f"{stream}.dlq")


def pod_stream(router: RedisRouter, stream: str, consumer: str) -> Callable[[Any], Any]:
    """`idempotent_stream` for consumer ``consumer`` of group ``workers`` (another pod)."""

    def decorate(handler: Any) -> Any:
        reading = router.subscriber(
            stream=StreamSub(stream, group="workers", consumer=consumer, max_records=10),
            ack_policy=AckPolicy.MANUAL,
        )
        claiming = router.subscriber(
            stream=StreamSub(
                stream, group="workers", consumer=consumer, min_idle_time=CLAIM_AFTER_MS
            ),
            ack_policy=AckPolicy.MANUAL,
        )
        return reading(claiming(handler))

    return decorate


def _failing(runs: list[str], pod: str) -> Callable[..., Any]:
    """A handler that records its pod's run and fails every time."""

    async def handle(data: dict[str, Any]) -> None:
        runs.append(pod)
        raise ConnectionError("the far side refuses it")

    return handle


async def test_redis_dead_letter_retried_in_hand_is_written_once_with_two_consumers(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    effects: None,
    stream: str,
) -> None:
    """A poison entry is due for its dead letter while ``<stream>.dlq`` refuses writes (a key
    of another type: WRONGTYPE, fixed by an operator a few seconds later). The consumer holds
    the entry in hand, retrying the dead letter; meanwhile it stays idle in the pending list,
    so the other consumer's claiming subscriber takes it, finds its budget spent and
    dead-letters it as well: once the operator fixes the key, both dead letters were written.
    The holder now keeps the entry claimed while it is in hand (``XCLAIM ... JUSTID``): the
    other consumer never takes it, and one dead letter is written."""
    await redis_client.set(f"{stream}.dlq", "not a stream")
    runs: list[str] = []
    brokers: list[RedisBroker] = []
    for pod in ("w1", "w2"):
        broker = RedisBroker(redis_url, logger=None)
        idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.1), max_deliveries=2)
        router = RedisRouter(middlewares=[idem])

        pod_stream(router, stream, pod)(_failing(runs, pod))
        broker.include_router(router)
        brokers.append(broker)
    try:
        for broker in brokers:
            await broker.start()
        await brokers[0].publish({"n": 1}, stream=stream, headers={"idempotency-key": "p"})
        await asyncio.sleep(3)  # the dead letter is refused meanwhile: held in hand
        assert len(runs) == 2  # the first run, then one claimed run: none while held
        await redis_client.delete(f"{stream}.dlq")  # the operator fixes the key

        async def settled() -> bool:
            return await pending(redis_client, stream) == 0

        await wait_until(settled, 30, "the poison dead-lettered and acked")
        await asyncio.sleep(2)  # a second holder's retry would land meanwhile
    finally:
        for broker in brokers:
            await broker.stop()
    assert len(await redis_client.xrange(f"{stream}.dlq")) == 1


async def test_nats_lock_wait_on_the_claim_spends_no_delivery_budget(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    pg_dsn: str,
    effects: None,
    subject: str,
) -> None:
    """The Redis case above on JetStream, which naks a wait and redelivers it
    (``num_delivered`` above 1: counted ahead of its handler): a lock wait on the records
    table must not dead-letter a message that never ran."""
    impatient = await asyncpg.create_pool(
        pg_dsn, min_size=1, max_size=4, server_settings={"lock_timeout": "200"}
    )
    assert impatient is not None
    broker = NatsBroker(nats_url)
    idem = Idempotency(
        PostgresStore(impatient, schema=store.schema),
        broker=broker,
        scope=scope,
        backoff=(0.05, 0.1),
        max_deliveries=2,
    )
    router = NatsRouter(middlewares=[idem])
    runs: list[int] = []

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(data["n"])
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:
        async with pg_pool.acquire() as locker, locker.transaction():
            await locker.execute(f"LOCK TABLE {store.table} IN ACCESS EXCLUSIVE MODE")
            await broker.publish({"n": 1}, subject, headers={"idempotency-key": "k1"})
            await asyncio.sleep(3)
            assert idem.stats.retries > 3  # naked and redelivered again and again
            assert runs == [] and idem.stats.dead_lettered == 0

        async def settled() -> bool:
            return idem.stats.processed >= 1

        await wait_until(settled, 15, "the message run once the lock is gone")
    finally:
        await broker.stop()
        await impatient.close()
    assert runs == [1] and idem.stats.dead_lettered == 0 and idem.stats.executed == 1
    assert await effect_count(pg_pool, scope) == 1
    assert await nats_pending(nats_url, subject) == (0, 0)


async def test_redis_entry_whose_handler_outlasts_min_idle_time_stays_with_its_consumer(
    redis_url: str,
    redis_client: aioredis.Redis,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    stream: str,
) -> None:
    """A handler running four times ``min_idle_time``, two consumers: the entry in hand is kept
    claimed, so the other consumer never takes it (no second delivery, no replay)."""
    runs: list[str] = []
    brokers: list[RedisBroker] = []
    idems: list[Idempotency] = []
    for pod in ("w1", "w2"):
        broker = RedisBroker(redis_url, logger=None)
        idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.1))
        router = RedisRouter(middlewares=[idem])
        pod_stream(router, stream, pod)(_slow(runs, pod, 4 * CLAIM_AFTER_MS / 1000))
        broker.include_router(router)
        brokers.append(broker)
        idems.append(idem)
    try:
        for broker in brokers:
            await broker.start()
        await brokers[0].publish({"n": 1}, stream=stream, headers={"idempotency-key": "slow"})

        async def settled() -> bool:
            return sum(i.stats.processed for i in idems) >= 1

        await wait_until(settled, 15, "the slow entry settled")
        await asyncio.sleep(2 * CLAIM_AFTER_MS / 1000)
    finally:
        for broker in brokers:
            await broker.stop()
    assert len(runs) == 1
    assert sum(i.stats.duplicates for i in idems) == 0  # never delivered to the other
    assert await pending(redis_client, stream) == 0
    assert await effect_count(pg_pool, scope) == 1


def _slow(runs: list[str], pod: str, seconds: float) -> Callable[..., Any]:
    """A handler that records its pod's run, takes ``seconds``, then writes its effect."""

    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(pod)
        await asyncio.sleep(seconds)
        await write_effect(conn, current, data["n"])

    return handle
