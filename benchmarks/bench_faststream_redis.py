"""FastStream on Redis Streams: the same subscriber pair of one consumer group (a reading
subscriber and a claiming one, ``AckPolicy.MANUAL``; the demo effect, one ledger row and the
account balance, in a transaction, then the ``XACK``) with and without the ``Idempotency``
middleware.

One stream is filled with ``COUNT`` payments once; each run reads it from the start with a new
consumer group (and, for the middleware, a new scope, so every message runs). Rates run from
the first settled message to the last. One run of each first, not counted (the first reads of
the stream and the first statements of a pool cost more), then ``ROUNDS`` rounds, baseline and
subject alternating which goes first; medians.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from benchmarks.bench_consumers import alternate
from benchmarks.common import Clock, entry, scratch_database, settled_rate
from benchmarks.pg_cpu import SidesCpu, postmaster_of
from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from consumer_idem.message import ConsumerMessage
from examples.payments_producer import plan
from handlers.payments import ensure_tables, record_payment

#: payments in the stream (each run reads all of them)
COUNT = 1_000
#: many short rounds: on a shared machine one round in five can land in another load burst
ROUNDS = 9
#: the claiming subscriber's idle time (ms): longer than a run, so it only polls
CLAIM_AFTER_MS = 60_000


async def fill(stream: str, run_id: str) -> None:
    """``COUNT`` payments, each with its ``idempotency-key``, published through FastStream."""
    from faststream.redis import RedisBroker

    async with RedisBroker(load_settings().redis_url, logger=None) as broker:
        for m in plan(COUNT, 0.0, 1, run_id):
            await broker.publish(m.body, stream=stream, headers={"idempotency-key": m.key})


async def faststream_redis(
    pool: asyncpg.Pool, store: PostgresStore, stream: str, idempotent: bool
) -> float:
    """One run of the subscriber pair over the whole stream, with or without the middleware."""
    from faststream import AckPolicy
    from faststream.redis import RedisBroker, RedisRouter, RedisStreamMessage, StreamSub

    from consumer_idem.faststream import CurrentIdempotency, Idempotency

    settings = load_settings()
    group = f"bench-{uuid.uuid4().hex[:8]}"
    client = aioredis.from_url(settings.redis_url)
    try:
        await client.xgroup_create(stream, group, id="0")  # the whole stream, from its start
    finally:
        await client.aclose()
    broker = RedisBroker(settings.redis_url, logger=None)
    idem = None
    router = RedisRouter()
    if idempotent:
        idem = Idempotency(
            store, broker=broker, scope=f"fsr-{uuid.uuid4().hex[:6]}", key=header("idempotency-key")
        )
        router = RedisRouter(middlewares=[idem])
    reading = router.subscriber(
        stream=StreamSub(stream, group=group, consumer="c1", max_records=10),
        ack_policy=AckPolicy.MANUAL,
    )
    claiming = router.subscriber(
        stream=StreamSub(stream, group=group, consumer="c1", min_idle_time=CLAIM_AFTER_MS),
        ack_policy=AckPolicy.MANUAL,
    )
    clock = Clock()
    if idem is not None:

        @reading
        @claiming
        async def idempotent_handler(body: dict[str, Any], current: CurrentIdempotency) -> None:
            assert current.conn is not None
            await record_payment(current.message, current.conn)

    else:

        @reading
        @claiming
        async def plain_handler(body: dict[str, Any], message: RedisStreamMessage) -> None:
            payment = ConsumerMessage(body=message.body)
            async with pool.acquire() as conn, conn.transaction():
                await record_payment(payment, conn)
            await message.ack()
            clock.tick()

    return await settled_rate(broker, router, clock, idem, COUNT, 300)


async def run() -> list[dict[str, Any]]:
    run_id = uuid.uuid4().hex[:8]
    stream = f"bench-fsr-{run_id}"
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=10)
        assert pool is not None
        client = aioredis.from_url(load_settings().redis_url)
        try:
            store = PostgresStore(pool)
            await store.migrate()
            await ensure_tables(pool)
            await fill(stream, run_id)
            await faststream_redis(pool, store, stream, False)
            await faststream_redis(pool, store, stream, True)
            cpu = SidesCpu(await postmaster_of(dsn))
            base, subject, ratios = await alternate(
                ROUNDS,
                cpu.metered(False, COUNT, lambda: faststream_redis(pool, store, stream, False)),
                cpu.metered(True, COUNT, lambda: faststream_redis(pool, store, stream, True)),
            )
            print(f"   faststream redis ratios per round: {ratios}; cpu: {cpu.us}", flush=True)
        finally:
            await client.delete(stream)
            await client.aclose()
            await pool.close()
    return [
        entry("faststream.redis.plain", base, "msg/s", None),
        entry("faststream.redis.idempotent", subject, "msg/s", base),
        cpu.entry("consumer.cpu_per_message.faststream.redis"),
    ]
