"""Adversarial review of the NATS batch crash budget (``consumer_idem.faststream.batch_budget``)
and of the give-back of a counted run that only waited, on a real NATS server with JetStream
and a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats
import pytest
from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import CurrentIdempotencyBatch, Idempotency, IdempotentConnection
from tests._payments import wait_until
from tests.conftest import unique
from tests.test_faststream_nats_batch import batch_app, effects_by_key, pending, publish


@pytest.fixture
async def subject(nats_url: str) -> AsyncIterator[str]:
    """A subject of its own, in a stream of its own (with its ``.dlq``), deleted after."""
    name = unique("rv2")
    yield name
    client = await nats.connect(nats_url)
    try:
        await client.jsm().delete_stream(name)
    except Exception:  # never created
        pass
    finally:
        await client.close()


async def test_nats_batch_member_lock_wait_on_the_claim_spends_no_delivery_budget(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    pg_dsn: str,
    effects: None,
    subject: str,
) -> None:
    """A role with a ``lock_timeout`` while a maintenance statement holds the records table:
    every claim of a batch member runs out of lock time and waits, its handler never
    starting. Redelivered, the member runs alone under the crash budget, counting an attempt
    ahead of its claim; a run that only waited must give it back, or after
    ``max_deliveries`` waits the healthy member is dead-lettered (``max_deliveries``) once the
    lock goes, without ever having run."""
    impatient = await asyncpg.create_pool(
        pg_dsn, min_size=1, max_size=4, server_settings={"lock_timeout": "200"}
    )
    assert impatient is not None
    broker, idem, calls = batch_app(
        nats_url,
        PostgresStore(impatient, schema=store.schema),
        scope,
        subject,
        backoff=(0.05, 0.1),
        max_deliveries=2,
    )
    await broker.start()
    try:
        async with pg_pool.acquire() as locker, locker.transaction():
            await locker.execute(f"LOCK TABLE {store.table} IN ACCESS EXCLUSIVE MODE")
            await publish(broker, subject, [("k1", {"n": 1})])
            await asyncio.sleep(4)
            assert calls == [] and idem.stats.dead_lettered == 0

        async def settled() -> bool:
            return await pending(nats_url, subject) == (0, 0)

        await wait_until(settled, 20, "the member run once the lock is gone")
    finally:
        await broker.stop()
        await impatient.close()
    assert idem.stats.dead_lettered == 0
    assert calls == [["k1"]]
    assert await effects_by_key(pg_pool, scope) == {"k1": 1}


async def test_nats_batch_member_whose_handler_statement_always_times_out_is_dead_lettered(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
) -> None:
    """A member whose handler's own statement always runs past ``statement_timeout`` (a
    payload that makes the handler's query pathological): each run ends as a
    ``store_unavailable`` wait, but its handler started, so its counted attempt is kept
    (only a run that never reached its handler gives it back) and it is dead-lettered after
    ``max_deliveries`` counted runs instead of running for ever."""
    broker = NatsBroker(nats_url)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.1), max_deliveries=2)
    router = NatsRouter(middlewares=[idem])
    runs: list[list[str]] = []

    @router.subscriber(
        subject,
        stream=JStream(subject, subjects=[subject, f"{subject}.dlq"]),
        durable="worker",
        pull_sub=PullSub(10, timeout=0.3, batch=True),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> None:
        runs.append(list(current.keys))
        await conn.execute("SET LOCAL statement_timeout = 50")
        await conn.execute("SELECT pg_sleep(0.5)")

    broker.include_router(router)
    await broker.start()
    try:
        await publish(broker, subject, [("slow", {"n": 1})])

        async def dead_lettered() -> bool:
            return idem.stats.dead_lettered == 1 or len(runs) > 20

        await wait_until(dead_lettered, 15, "the member dead-lettered, or run 20 times")
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 1, f"run {len(runs)} times, never dead-lettered"
    assert len(runs) <= 2 * (2 + 1)  # a batch of one runs its handler twice when it fails
