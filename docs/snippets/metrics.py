"""Metrics: counters per scope, in-process and (with prometheus-client) for Prometheus."""

import asyncio
import os
import uuid

import asyncpg
from prometheus_client import CollectorRegistry, generate_latest

from consumer_idem import ConsumerMessage, Metrics, PostgresStore, idempotent_consumer

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    # --8<-- [start:metrics]
    registry = CollectorRegistry()  # or leave it out: prometheus-client's default registry
    store = PostgresStore(pool, metrics=Metrics(registry))
    # --8<-- [end:metrics]
    await store.migrate()

    @idempotent_consumer(store, scope="docs.metered")
    async def handle(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        pass

    message = ConsumerMessage(b"{}", {"idempotency-key": uuid.uuid4().hex.encode()})
    for _ in range(3):
        await handle.process(message)
    print("created", store.metrics.count("created", "docs.metered"))  # in-process
    print("replay", store.metrics.count("replay", "docs.metered"))
    exported = generate_latest(registry).decode()
    print([line for line in exported.splitlines() if "docs.metered" in line])
    assert 'consumer_idem_events_total{event="replay",scope="docs.metered"} 2.0' in exported
    await pool.close()


asyncio.run(main())
