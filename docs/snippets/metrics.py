"""Metrics: counters per scope, in-process and (with prometheus-client) for
Prometheus."""

# --8<-- [start:metrics]
import os

from prometheus_client import CollectorRegistry

from consumer_idem import Metrics, PostgresStore

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# or leave `registry` out: prometheus-client's default registry
registry = CollectorRegistry()
store = PostgresStore.from_dsn(DSN, metrics=Metrics(registry))
# --8<-- [end:metrics]


async def main() -> None:
    import uuid

    import asyncpg
    from prometheus_client import generate_latest

    from consumer_idem import ConsumerMessage, idempotent_consumer

    await store.migrate()

    @idempotent_consumer(store, scope="docs.metered")
    async def handle(
        message: ConsumerMessage, conn: asyncpg.Connection
    ) -> None:
        pass

    key = {"idempotency-key": uuid.uuid4().hex.encode()}
    message = ConsumerMessage(b"{}", key)
    for _ in range(3):
        await handle.process(message)
    # in-process
    print("created", store.metrics.count("created", "docs.metered"))
    print("replay", store.metrics.count("replay", "docs.metered"))
    exported = generate_latest(registry).decode()
    print([line for line in exported.splitlines() if "docs.metered" in line])
    expected = (
        'consumer_idem_events_total{event="replay",scope="docs.metered"} 2.0'
    )
    assert expected in exported
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
