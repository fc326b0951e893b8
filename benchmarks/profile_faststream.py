"""Where a FastStream bench's idempotent side spends its extra time: one uncounted run, then
one run under cProfile, of one side of one family; prints the rate, the socket sends (one per
round trip to Postgres or to the broker; Confluent's go through librdkafka's threads and are
not seen), the time idle in the event loop, and the hottest functions; then the CPU seconds
per message of this process and of the scratch database's Postgres backends (read from
``/proc``: Postgres on this machine). Compare the two sides::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.profile_faststream nats idem 1500
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.profile_faststream nats plain 1500

A fourth argument ``noprof`` measures the run without cProfile (the CPU figures then carry no
profiler overhead).

Families: nats (``PullSub`` of 32), redis, confluent (per message). Not part of ``make bench``.
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import pstats
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks.common import scratch_database
from consumer_idem import PostgresStore
from consumer_idem.cli.settings import load_settings
from handlers.payments import ensure_tables

_COUNTED = {
    "<method 'send' of '_socket.socket' objects>": "sends",
    "<method 'poll' of 'select.epoll' objects>": "idle_s",
}


async def _nats(pool: asyncpg.Pool, store: PostgresStore, idem: bool, count: int) -> Any:
    from benchmarks import bench_faststream_nats as bench

    stream = f"bench-fsn-{uuid.uuid4().hex[:8]}"
    await bench.fill(stream, count, stream)
    try:
        await bench.faststream_nats(pool, store, stream, idem, count=count)
        return await _profiled(bench.faststream_nats(pool, store, stream, idem, count=count))
    finally:
        await bench.drop(stream)


async def _redis(pool: asyncpg.Pool, store: PostgresStore, idem: bool, count: int) -> Any:
    import redis.asyncio as aioredis

    from benchmarks import bench_faststream_redis as bench

    bench.COUNT = count
    stream = f"bench-fsr-{uuid.uuid4().hex[:8]}"
    await bench.fill(stream, stream)
    try:
        await bench.faststream_redis(pool, store, stream, idem)
        return await _profiled(bench.faststream_redis(pool, store, stream, idem))
    finally:
        client = aioredis.from_url(load_settings().redis_url)
        await client.delete(stream)
        await client.aclose()


async def _confluent(pool: asyncpg.Pool, store: PostgresStore, idem: bool, count: int) -> Any:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from benchmarks import bench_faststream_confluent as bench
    from examples.payments_producer import plan, send_kafka

    bench.PER_MESSAGE = count
    topic = f"bench-confluent-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=load_settings().kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
        await send_kafka(plan(count, 0.0, 1, topic), topic)
        await bench.per_message(pool, store, topic, idem)
        return await _profiled(bench.per_message(pool, store, topic, idem))
    finally:
        await admin.delete_topics([topic])
        await admin.close()


#: set by `main`: profile the measured run
_PROFILE = True
#: the scratch database's pool, for its backends' CPU
_POOL: Any = None


async def _backend_cpu() -> dict[int, float]:
    """CPU seconds so far of each Postgres backend connected to the scratch database."""
    async with _POOL.acquire() as conn:
        pids = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        )
    return _cpu_of([row["pid"] for row in pids])


def _cpu_of(pids: list[int]) -> dict[int, float]:
    """utime + stime of each of ``pids`` still running, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    return cpu


async def _profiled(run: Any) -> tuple[float, pstats.Stats | None, dict[str, float]]:
    profile = cProfile.Profile()
    before = await _backend_cpu()
    started, cpu = time.perf_counter(), time.process_time()
    if _PROFILE:
        profile.enable()
    try:
        rate = await run
    finally:
        profile.disable()
    spent = {"wall_s": time.perf_counter() - started, "python_cpu_s": time.process_time() - cpu}
    after = await _backend_cpu()
    spent["postgres_cpu_s"] = sum(t - before.get(pid, 0.0) for pid, t in after.items())
    return rate, pstats.Stats(profile) if _PROFILE else None, spent


async def main(family: str, side: str, count: int, profiled: bool) -> None:
    global _PROFILE, _POOL
    _PROFILE = profiled
    runner = {"nats": _nats, "redis": _redis, "confluent": _confluent}[family]
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        assert pool is not None
        _POOL = pool
        try:
            await ensure_tables(pool)
            store = PostgresStore(pool)
            await store.migrate()
            rate, stats, spent = await runner(pool, store, side == "idem", count)
        finally:
            await pool.close()
    per = {k.replace("_s", "_ms_per_msg"): round(v / count * 1000, 3) for k, v in spent.items()}
    print(f"{family} {side}: {rate:.1f} msg/s, {count} messages, {per}")
    if stats is not None:
        raw: dict[Any, Any] = stats.stats
        seen = {lab: (v[1], round(v[2], 3)) for k, v in raw.items() if (lab := _COUNTED.get(k[2]))}
        print(f"profiled: {seen}")
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    family, side = sys.argv[1], sys.argv[2]
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    asyncio.run(main(family, side, count, sys.argv[4:5] != ["noprof"]))
