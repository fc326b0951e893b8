"""Adversarial review of the NATS batch crash budget (``consumer_idem.faststream.batch_budget``)
and of the give-back of a counted run that only waited, on a real NATS server with JetStream
and a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import nats
import pytest

from consumer_idem import PostgresStore
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
