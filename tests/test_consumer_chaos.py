"""Crash and rebalance tests: real consumer processes, SIGKILLed and restarted, on real brokers."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import uuid
from typing import Any

import aio_pika
import asyncpg
import pytest

from consumer_idem import PostgresStore
from examples.payments_producer import plan, send_kafka, send_rabbit
from tests._payments import assert_exactly_once, ledger_count, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def start_consumer(
    pg_dsn: str, transport: str, topic: str, *extra: str
) -> asyncio.subprocess.Process:
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.payments_consumer",
        "--transport",
        transport,
        "--topic",
        topic,
        *extra,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    assert json.loads(line)["event"] == "started", line
    return proc


async def stop_consumer(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
async def test_sigkill_ten_times_during_a_run_loses_and_doubles_nothing(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    amqp_connection: aio_pika.abc.AbstractConnection,
    transport: str,
) -> None:
    run_id = f"chaos{uuid.uuid4().hex[:6]}"
    messages = plan(2000, 0.1, 3, run_id)
    if transport == "kafka":
        topic = await kafka_topic_factory("chaos", partitions=4)
        await send_kafka(messages, topic)
        # static membership: a restarted process takes its partitions back without waiting
        # for the dead one's session to time out
        # (4 partitions run in parallel: ~200 msg/s, so the ten kills land mid-run)
        extra = ["--group", run_id, "--instance-id", f"{run_id}-1", "--slow-ms", "20"]
    else:
        topic = f"chaos-{run_id}"
        await send_rabbit(messages, topic)
        extra = ["--slow-ms", "150"]  # 32 prefetched in parallel: ~200 msg/s
    rng = random.Random(run_id)
    kills = 0
    try:
        while kills < 10:
            proc = await start_consumer(pg_dsn, transport, topic, *extra)
            await asyncio.sleep(rng.uniform(0.3, 0.9))
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            kills += 1
        booked = await ledger_count(pg_pool, run_id)
        assert 0 < booked < 2000, f"the kills must land mid-run (booked {booked})"
        final = await start_consumer(pg_dsn, transport, topic, *extra)

        async def all_booked() -> bool:
            return await ledger_count(pg_pool, run_id) >= 2000

        await wait_until(all_booked, 180, "the last consumer to finish")
        await asyncio.sleep(1.0)  # anything still arriving would be a double
        await stop_consumer(final)
    finally:
        if transport == "rabbit":
            channel = await amqp_connection.channel()
            await channel.queue_delete(topic)
            for suffix in (".dlq",):
                await channel.queue_delete(topic + suffix)
            await channel.close()
    await assert_exactly_once(pg_pool, run_id, messages)
    await store.maintenance.sweep()
    stuck = await pg_pool.fetchval(
        f"SELECT count(*) FROM {store.table} WHERE scope = 'payments.ledger'"
        " AND status = 'in_progress'"
    )
    assert stuck == 0


async def test_two_consumers_in_one_group_with_rebalances(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
) -> None:
    run_id = f"rebal{uuid.uuid4().hex[:6]}"
    topic = await kafka_topic_factory("rebal", partitions=4)
    messages = plan(2000, 0.2, 4, run_id)
    await send_kafka(messages, topic)
    args = ["--group", run_id, "--slow-ms", "3"]
    first = await start_consumer(pg_dsn, "kafka", topic, *args)

    async def booked(n: int) -> bool:
        return await ledger_count(pg_pool, run_id) >= n

    await wait_until(lambda: booked(300), 60, "the first consumer to make progress")
    second = await start_consumer(pg_dsn, "kafka", topic, *args)  # joins: rebalance
    await wait_until(lambda: booked(1000), 60, "progress after the join")
    first_stats = await stop_consumer(first)  # leaves: rebalance again
    await wait_until(lambda: booked(2000), 120, "the second consumer to finish")
    await asyncio.sleep(1.0)
    second_stats = await stop_consumer(second)
    assert first_stats["processed"] > 0 and second_stats["processed"] > 0
    await assert_exactly_once(pg_pool, run_id, messages)
