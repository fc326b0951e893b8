"""The transactional outbox's cost: the payments unit (one ledger row + the account balance)
with one outgoing message through the outbox, against the same unit without it, same run, same
pre-filled topic (one partition), each run with a new consumer group and a new scope.

A run with the outbox counts as done only when every delivery is settled *and* every outgoing
message was confirmed by Kafka and marked sent (``outbox_sent``, or ``outbox_relayed`` for one
the dispatch left to the runner's relay), so the rate includes the dispatch, not only the
inserts. Runs alternate (baseline, outbox, baseline, ...) and each side's
median counts: the machine is small and noisy.

  outbox.kafka.one_message_per_unit: one transaction per message (KafkaRunner)
  outbox.kafka.batch_mode:           one transaction per fetched batch (batch=True)
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.common import entry, scratch_database
from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer, outbox_for
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.kafka import KafkaRunner
from examples.payments_producer import plan, send_kafka
from handlers.payments import ensure_tables, record_payment, record_payments

ONE = 5_000  #: messages per one-per-transaction run (~600 msg/s here: seconds per run)
BATCH = 20_000  #: messages per batch-mode run
RUNS = 3  #: runs per side, one message per transaction (tens of seconds each)
BATCH_RUNS = 5  #: runs per side, batch mode (seconds each: more of them, the median steadier)


async def timed(runner: KafkaRunner, store: PostgresStore, scope: str, n: int, out: bool) -> float:
    """Messages per second from the first settled delivery until ``n`` are settled and, with
    ``out``, ``n`` outgoing messages are confirmed and marked sent."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    first: float | None = None
    try:
        deadline = time.monotonic() + 600
        while True:
            processed = runner.stats.processed
            if processed and first is None:
                first = time.perf_counter()
            # sent right after the commit, or (a dispatch left behind) by the relay
            metrics = store.metrics
            sent = metrics.count("outbox_sent", scope) + metrics.count("outbox_relayed", scope)
            sent = sent if out else n
            if processed >= n and sent >= n:
                last = time.perf_counter()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"run did not finish: {processed} settled, {sent} sent")
            await asyncio.sleep(0.002)
    finally:
        stop.set()
        await task
    assert first is not None
    return (n - 1) / max(last - first, 1e-9)


async def one_run(
    store: PostgresStore, topic: str, events: str, n: int, batch: bool, out: bool
) -> float:
    scope = f"bench-{uuid.uuid4().hex[:6]}"

    async def one(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await record_payment(message, conn)
        if out:
            outbox_for(conn).publish(events, message.body, key=message.record_key)

    async def many(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(messages, conn)
        for message in messages if out else ():
            outbox_for(conn, message).publish(events, message.body, key=message.record_key)

    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=batch)(
        many if batch else one
    )
    runner = KafkaRunner(
        consumer, topics=[topic], group_id=f"outbox-{uuid.uuid4().hex}", outbox_relay=1.0
    )
    return await timed(runner, store, scope, n, out)


async def compare(
    store: PostgresStore, topic: str, events: str, n: int, batch: bool, runs: int
) -> tuple[float, float]:
    """(baseline median, outbox median), alternating runs."""
    base: list[float] = []
    subject: list[float] = []
    for r in range(runs):
        for out in (False, True) if r % 2 == 0 else (True, False):
            rate = await one_run(store, topic, events, n, batch, out)
            (subject if out else base).append(rate)
            print(f"  {'batch' if batch else 'one'} {'outbox' if out else 'plain'}: {rate:.0f}/s")
    return statistics.median(base), statistics.median(subject)


async def run() -> list[dict[str, Any]]:
    settings = load_settings()
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        store.outbox.relay_after = 5.0  # the relay only takes what the dispatch left behind
        await store.migrate()
        run_id = uuid.uuid4().hex[:8]
        one_topic, batch_topic = f"bench-ob1-{run_id}", f"bench-obb-{run_id}"
        events = f"bench-obout-{run_id}"
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        await admin.start()
        topics = (one_topic, batch_topic, events)
        await admin.create_topics([NewTopic(t, 1, 1) for t in topics])
        try:
            await send_kafka(plan(ONE, 0.0, 1, run_id), one_topic)
            await send_kafka(plan(BATCH, 0.0, 2, run_id), batch_topic)
            one_base, one_out = await compare(store, one_topic, events, ONE, False, RUNS)
            batch_base, batch_out = await compare(
                store, batch_topic, events, BATCH, True, BATCH_RUNS
            )
        finally:
            await admin.delete_topics(list(topics))
            await admin.close()
            await pool.close()
    return [
        entry("outbox.kafka.one_message_per_unit", one_out, "msg/s", one_base),
        entry("outbox.kafka.batch_mode", batch_out, "msg/s", batch_base),
    ]
