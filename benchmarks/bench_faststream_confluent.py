"""FastStream on Confluent's Kafka client (``faststream.confluent``), one partition: the same
subscriber (``AckPolicy.MANUAL``, the demo effect in a transaction, then the ack) with and
without the ``Idempotency`` middleware, per message and as a batch subscriber (``batch=True``,
the set-based effect per delivered batch, then the commit).

Rates run from the first settled message to the last, so joining the group is not counted.
Each run reads the topic with a new consumer group and, for the middleware, a new scope; the
plain subscriber and the idempotent one alternate (the first of a round alternates too) after
one uncounted run of each, medians: per message five rounds over the first ``PER_MESSAGE``
records, batches five rounds over the whole topic.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.bench_consumers import alternate, faststream_kafka, faststream_kafka_batch
from benchmarks.common import entry, scratch_database, settle
from benchmarks.pg_cpu import SidesCpu, postmaster_of
from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.kafka import to_message
from examples.payments_producer import plan, send_kafka
from handlers.payments import ensure_tables

#: records on the topic (the batch runs read them all)
N = 10_000
#: per message, a Kafka commit each: the first PER_MESSAGE records per run
PER_MESSAGE = 1_000
ROUNDS = 5


def _broker(store: PostgresStore, idempotent: bool) -> tuple[Any, Any, Any]:
    """A Confluent KafkaBroker and a router for one run, the router behind the middleware
    (returned too, for its stats) when ``idempotent``."""
    from faststream.confluent import KafkaBroker, KafkaRouter

    from consumer_idem.faststream import Idempotency

    broker = KafkaBroker(load_settings().kafka_bootstrap, acks="all", logger=None)
    if not idempotent:
        return broker, KafkaRouter(), None
    idem = Idempotency(
        store, broker=broker, scope=f"fsc-{uuid.uuid4().hex[:6]}", key=header("idempotency-key")
    )
    return broker, KafkaRouter(middlewares=[idem]), idem


def _view(raw: Any) -> Any:
    from consumer_idem.faststream.confluent_side import record_view

    return to_message(record_view(raw))


async def per_message(
    pool: asyncpg.Pool, store: PostgresStore, topic: str, idempotent: bool
) -> float:
    return await faststream_kafka(
        pool, store, topic, idempotent, PER_MESSAGE, make=_broker, view=_view
    )


async def batches(pool: asyncpg.Pool, store: PostgresStore, topic: str, idempotent: bool) -> float:
    return await faststream_kafka_batch(pool, store, topic, idempotent, N, make=_broker, view=_view)


async def run() -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        await store.migrate()
        run_id = uuid.uuid4().hex[:8]
        topic = f"bench-confluent-{run_id}"
        admin = AIOKafkaAdminClient(bootstrap_servers=load_settings().kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
            await send_kafka(plan(N, 0.0, 1, run_id), topic)
            for idempotent in (False, True):  # uncounted: the first reads of a topic cost more
                await per_message(pool, store, topic, idempotent)
            cpu = SidesCpu(await postmaster_of(dsn))
            base, subject, ratios = await alternate(
                ROUNDS,
                cpu.metered(False, PER_MESSAGE, lambda: per_message(pool, store, topic, False)),
                cpu.metered(True, PER_MESSAGE, lambda: per_message(pool, store, topic, True)),
            )
            print(f"   per message ratios per round: {ratios}; cpu: {cpu.us}", flush=True)
            results += [
                entry("faststream.confluent.plain", base, "msg/s", None),
                entry("faststream.confluent.idempotent", subject, "msg/s", base),
                cpu.entry("consumer.cpu_per_message.faststream.confluent"),
            ]
            await settle()
            for idempotent in (False, True):
                await batches(pool, store, topic, idempotent)
            batch_cpu = SidesCpu(cpu.postmaster)
            base, subject, ratios = await alternate(
                ROUNDS,
                batch_cpu.metered(False, N, lambda: batches(pool, store, topic, False)),
                batch_cpu.metered(True, N, lambda: batches(pool, store, topic, True)),
            )
            print(f"   batch ratios per round: {ratios}; cpu: {batch_cpu.us}", flush=True)
            results += [
                entry("faststream.confluent.plain.batch", base, "msg/s", None),
                entry("faststream.confluent.idempotent.batch", subject, "msg/s", base),
                batch_cpu.entry("consumer.cpu_per_message.faststream.confluent.batch"),
            ]
        finally:
            await admin.delete_topics([topic])
            await admin.close()
            await pool.close()
    for r in results:
        print(f"   {r}", flush=True)
    return results
