"""FastStream on NATS JetStream: the same pull subscriber with and without the ``Idempotency``
middleware, in one run.

One stream is filled once with ``COUNT`` payments (an ``idempotency-key`` header each); each run
reads all of it through a new durable consumer (explicit acks), ``PullSub(BATCH)``: FastStream
fetches up to ``BATCH`` messages and runs them side by side. Both sides run the demo effect (one
ledger row + the account balance) in a transaction, then ack the message with ``ack_sync`` (the
server confirms it), as the middleware does (``AckPolicy.MANUAL`` on both). Rates run from the
first settled message to the last. A warm-up run of each, then five rounds, alternating which
side runs first; medians. Ratio = idempotent / plain. The same again for a batch pull
subscriber (``PullSub(BATCH, batch=True)``): the set-based effect per fetched batch in one
transaction, then an ``ack_sync`` per message (``.batch`` entries).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import nats
from nats.js import api

from benchmarks.bench_consumers import alternate
from benchmarks.common import Clock, entry, scratch_database, settled_rate
from benchmarks.pg_cpu import SidesCpu, postmaster_of
from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from examples.payments_producer import plan
from handlers.payments import ensure_tables, record_payment, record_payments

#: messages per run (each side reads the whole stream)
COUNT = 3_000
#: messages fetched per pull request, run side by side
BATCH = 32


async def fill(stream: str, count: int, run_id: str) -> None:
    """A stream of its own holding ``count`` payments."""
    client = await nats.connect(load_settings().nats_url)
    try:
        js = client.jetstream()
        await js.add_stream(api.StreamConfig(name=stream, subjects=[stream]))
        for m in plan(count, 0.0, 3, run_id):
            await js.publish(stream, m.body, headers={"idempotency-key": m.key})
    finally:
        await client.close()


async def drop(stream: str) -> None:
    client = await nats.connect(load_settings().nats_url)
    try:
        await client.jsm().delete_stream(stream)
    finally:
        await client.close()


async def faststream_nats(
    pool: asyncpg.Pool,
    store: PostgresStore,
    stream: str,
    idempotent: bool,
    batch: int = BATCH,
    count: int = COUNT,
    batched: bool = False,
) -> float:
    """One run of the pull subscriber (``PullSub(batch)``; ``batched``: a batch subscriber,
    ``PullSub(batch, batch=True)``) through a new durable consumer, until ``count`` messages
    are settled: msg/s."""
    from faststream import AckPolicy
    from faststream.nats import JStream, NatsBroker, NatsMessage, NatsRouter, PullSub

    from consumer_idem.faststream import (
        CurrentIdempotency,
        CurrentIdempotencyBatch,
        Idempotency,
    )
    from consumer_idem.message import ConsumerMessage

    broker = NatsBroker(load_settings().nats_url, logger=None)
    idem = None
    if idempotent:
        idem = Idempotency(
            store,
            broker=broker,
            scope=f"fsn-{uuid.uuid4().hex[:6]}",
            key=header("idempotency-key"),
            outbox_relay=None,
        )
    router = NatsRouter(middlewares=[idem] if idem is not None else [])
    clock = Clock()
    options: dict[str, Any] = {
        "stream": JStream(stream, declare=False),
        "durable": f"bench-{uuid.uuid4().hex[:8]}",
        "pull_sub": PullSub(batch, timeout=0.2 if batched else 1.0, batch=batched),
        "ack_policy": AckPolicy.MANUAL,
    }
    if batched and idem is not None:

        @router.subscriber(stream, **options)
        async def idempotent_batch(
            bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch
        ) -> None:
            await record_payments(current.messages, current.conn)

    elif batched:

        @router.subscriber(stream, **options)
        async def plain_batch(bodies: list[dict[str, Any]], message: NatsMessage) -> None:
            raws = message.raw_message
            async with pool.acquire() as conn, conn.transaction():
                await record_payments(
                    [ConsumerMessage(body=r.data, headers={}) for r in raws], conn
                )
            await asyncio.gather(*(r.ack_sync() for r in raws))  # as the middleware acks
            clock.tick(len(raws))

    elif idem is not None:

        @router.subscriber(stream, **options)
        async def idempotent_handler(body: dict[str, Any], current: CurrentIdempotency) -> None:
            assert current.conn is not None
            await record_payment(current.message, current.conn)

    else:

        @router.subscriber(stream, **options)
        async def plain_handler(body: dict[str, Any], message: NatsMessage) -> None:
            raw = message.raw_message
            async with pool.acquire() as conn, conn.transaction():
                await record_payment(ConsumerMessage(body=raw.data, headers={}), conn)
            await message.ack_sync()
            clock.tick()

    return await settled_rate(broker, router, clock, idem, count, 300)


async def run() -> list[dict[str, Any]]:
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        await store.migrate()
        run_id = uuid.uuid4().hex[:8]
        stream = f"bench-fsn-{run_id}"
        await fill(stream, COUNT, run_id)
        try:
            # one run of each first, not counted (the first reads of a new stream cost more)
            await faststream_nats(pool, store, stream, False)
            await faststream_nats(pool, store, stream, True)
            cpu = SidesCpu(await postmaster_of(dsn))
            base, subject, ratios = await alternate(
                5,
                cpu.metered(False, COUNT, lambda: faststream_nats(pool, store, stream, False)),
                cpu.metered(True, COUNT, lambda: faststream_nats(pool, store, stream, True)),
            )
            print(f"   faststream nats ratios per round: {ratios}; cpu: {cpu.us}", flush=True)
            # batch subscribers: one transaction per fetched batch, then an ack per message
            await faststream_nats(pool, store, stream, False, batched=True)
            await faststream_nats(pool, store, stream, True, batched=True)
            batch_cpu = SidesCpu(cpu.postmaster)
            batch_base, batch_subject, ratios = await alternate(
                5,
                batch_cpu.metered(
                    False, COUNT, lambda: faststream_nats(pool, store, stream, False, batched=True)
                ),
                batch_cpu.metered(
                    True, COUNT, lambda: faststream_nats(pool, store, stream, True, batched=True)
                ),
            )
            print(
                f"   faststream nats batch ratios per round: {ratios}; cpu: {batch_cpu.us}",
                flush=True,
            )
        finally:
            await drop(stream)
            await pool.close()
    return [
        entry("faststream.nats.plain", base, "msg/s", None),
        entry("faststream.nats.idempotent", subject, "msg/s", base),
        entry("faststream.nats.plain.batch", batch_base, "msg/s", None),
        entry("faststream.nats.idempotent.batch", batch_subject, "msg/s", batch_base),
        cpu.entry("consumer.cpu_per_message.faststream.nats"),
        batch_cpu.entry("consumer.cpu_per_message.faststream.nats.batch"),
    ]
