"""OpenTelemetry: set a tracer provider, and deliveries and requests are
traced (pip install opentelemetry-sdk)."""

import asyncio
import os
import uuid

import asyncpg

# --8<-- [start:setup]
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    idempotent_consumer,
    tracing,
)

# in production: OTLPSpanExporter(), BatchSpanProcessor
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
# that is all: deliveries and requests are traced
trace.set_tracer_provider(provider)
# optional: how keys appear in spans
tracing.configure(key="truncate", key_length=12)
# --8<-- [end:setup]

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()

    @idempotent_consumer(store, scope="docs.traced")
    async def handle(
        message: ConsumerMessage, conn: asyncpg.Connection
    ) -> None:
        await conn.execute("SELECT 1")

    key = f"k-{uuid.uuid4().hex[:8]}".encode()
    await handle.process(ConsumerMessage(b"{}", {"idempotency-key": key}))
    names = [span.name for span in exporter.get_finished_spans()]
    # the claim, your handler, the commit, inside the delivery's span
    print(names)
    assert {
        "consumer_idem.reserve",
        "consumer_idem.handler",
        "consumer_idem.commit",
    } <= set(names)
    await pool.close()


asyncio.run(main())
