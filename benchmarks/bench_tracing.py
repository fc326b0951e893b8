"""Tracing overhead: transactional deliveries through ``IdempotentConsumer.process`` (claim, the
demo ledger effect, COMMIT: the path every Kafka and RabbitMQ delivery takes), one at a time,
with tracing off (the baseline) and on (the SDK's TracerProvider, a BatchSpanProcessor and an
exporter that drops what it gets, so export cost is not counted), in alternating chunks.

Each delivery carries a producer's ``traceparent``, so the traced runs extract it as well.
Also measured: the OpenTelemetry API installed but no provider set (what a user without an SDK
pays: one check per hook). Run: ``python -m benchmarks.run tracing``.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from benchmarks.common import entry, interleaved, scratch_database
from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer, tracing
from handlers.payments import ensure_tables, record_payment

CHUNK = 500
CHUNKS = 12
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _messages(run: str, n: int) -> list[ConsumerMessage]:
    return [
        ConsumerMessage(
            json.dumps(
                {
                    "payment_id": f"{run}-{i}",
                    "customer_id": f"{run}-c{i % 50}",
                    "amount_cents": 100,
                    "currency": "EUR",
                }
            ).encode(),
            headers={"idempotency-key": f"{run}-{i}".encode(), "traceparent": TRACEPARENT},
        )
        for i in range(n)
    ]


async def run() -> list[dict[str, Any]]:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 16))
    cpu: dict[str, list[float]] = {"off": [], "on": [], "unset": []}
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
        assert pool is not None
        try:
            store = PostgresStore(pool)
            await store.migrate()
            await ensure_tables(pool)
            consumer = idempotent_consumer(store, scope="bench", key=header("idempotency-key"))(
                record_payment
            )

            def runner(name: str, **config: Any) -> Any:
                async def chunk(r: int) -> float:
                    tracing.configure(**config)
                    messages = _messages(f"{uuid.uuid4().hex[:8]}", CHUNK)
                    start, start_cpu = time.perf_counter(), time.process_time()
                    async with store.connection() as conn:  # as the runners do: one per run
                        for message in messages:
                            verdict = await consumer.process(message, conn)
                            assert verdict.action == "ack" and not verdict.duplicate
                    # CPU of the whole process (the span processor's thread included): the
                    # database's latency, which a busy machine makes noisy, is not in it
                    cpu[name].append((time.process_time() - start_cpu) / CHUNK * 1e6)
                    return CHUNK / (time.perf_counter() - start)

                return chunk

            off, on = await interleaved(
                CHUNKS, runner("off", enabled=False), runner("on", tracer_provider=provider)
            )
            off2, unset = await interleaved(CHUNKS, runner("off", enabled=False), runner("unset"))
        finally:
            tracing.configure()
            provider.shutdown()
            await pool.close()
    off_cpu, on_cpu, unset_cpu = (statistics.median(cpu[n]) for n in ("off", "on", "unset"))
    print(f"deliveries/s: off {off:.0f}, on {on:.0f}; off {off2:.0f}, no provider {unset:.0f}")
    print(
        f"CPU per delivery: off {off_cpu:.0f} µs, on {on_cpu:.0f} µs "
        f"(+{on_cpu - off_cpu:.0f} µs), no provider {unset_cpu:.0f} µs"
    )
    return [
        entry("transactional delivery, tracing on (deliveries/s)", on, "msg/s", off),
        entry("transactional delivery, tracing on (CPU per delivery)", on_cpu, "µs", off_cpu),
        entry(
            "transactional delivery, OTel API without provider (CPU per delivery)",
            unset_cpu,
            "µs",
            off_cpu,
        ),
    ]
