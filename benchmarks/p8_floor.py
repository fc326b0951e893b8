"""What idempotency costs at the least, one message per transaction on 8 partitions.

Not part of ``make bench`` (it writes no entry): it explains the entry
``kafka.idempotent.one_per_transaction.p8``. Three consumers read the same eight-partition
topic with the same concurrency (one worker per partition), in rotating rounds after an
uncounted run of each:

* ``plain``: the demo effect in a transaction per message (the entry's baseline);
* ``least``: the same, plus the least idempotency there is, written by hand: a two-column
  ``(scope, key)`` row inserted with ``ON CONFLICT DO NOTHING`` in the effect's transaction, the
  effect skipped when the row was there. No fingerprint, no check that the handler left the
  transaction alone, nothing to answer a duplicate with;
* ``library``: ``KafkaRunner`` with ``@idempotent_consumer``, as in the entry.

It prints each side's rates, their medians as ratios of ``plain``, and the CPU per message of
the consumer process, of PostgreSQL (the benchmark database's backends and the shared writers)
and of the broker, from ``/proc``. Run: ``python -m benchmarks.p8_floor [rounds]`` (default 5).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.bench_consumers import P8, idempotent_kafka, plain_kafka_per_partition, rotated
from benchmarks.common import scratch_database, settle
from benchmarks.kafka_scale import CpuWindow
from consumer_idem import PostgresStore
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.kafka import to_message
from examples.payments_producer import plan, send_kafka
from handlers.payments import ensure_tables, record_payment

KEYS_SQL = "CREATE TABLE floor_keys (scope text, key text, PRIMARY KEY (scope, key))"
CLAIM_SQL = "INSERT INTO floor_keys (scope, key) VALUES ($1, $2) ON CONFLICT DO NOTHING"


def least_unit(scope: str) -> Callable[[asyncpg.Connection, Any], Awaitable[None]]:
    """The hand-written unit: claim the key, run the effect if the claim is new, one transaction."""

    async def unit(conn: asyncpg.Connection, record: Any) -> None:
        message = to_message(record)
        key = message.headers["idempotency-key"].decode()
        async with conn.transaction():
            if await conn.execute(CLAIM_SQL, scope, key) == "INSERT 0 1":
                await record_payment(message, conn)

    return unit


async def main(rounds: int) -> None:
    settings = load_settings()
    run_id = uuid.uuid4().hex[:6]
    async with scratch_database() as dsn:
        database = urlsplit(dsn).path.lstrip("/")
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=40)
        store = PostgresStore(pool)
        await store.migrate()
        await ensure_tables(pool)
        await pool.execute(KEYS_SQL)
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        await admin.start()
        topic = f"bench-floor-{run_id}"
        await admin.create_topics([NewTopic(topic, 8, 1)])
        runs: dict[str, Callable[[], Awaitable[float]]] = {
            "plain": lambda: plain_kafka_per_partition(pool, topic, P8),
            # a new scope each run: every key is new
            "least": lambda: plain_kafka_per_partition(
                pool, topic, P8, least_unit(uuid.uuid4().hex[:8])
            ),
            "library": lambda: idempotent_kafka(store, topic, batch=False, count=P8),
        }
        names = list(runs)
        spent: dict[str, Counter[str]] = {name: Counter() for name in names}

        def measured(name: str) -> Callable[[], Awaitable[float]]:
            async def run() -> float:
                window = CpuWindow(database, [os.getpid()])
                window.start()
                rate = await runs[name]()
                window.stop()
                spent[name].update(window.spent)
                return rate

            return run

        try:
            await send_kafka(plan(P8, 0.0, 2, run_id), topic)
            await settle()
            sides = [measured(name) for name in names]
            for run in sides:  # not counted: the first reads of a new topic cost more
                await run()
            for counter in spent.values():
                counter.clear()
            rates = await rotated(rounds, sides)
        finally:
            await admin.delete_topics([topic])
            await admin.close()
            await pool.close()
    plain = statistics.median(rates[0])
    for name, values in zip(names, rates, strict=True):
        cpu = ", ".join(
            f"{group} {seconds / (P8 * rounds) * 1e6:.0f}"
            for group, seconds in sorted(spent[name].items())
        )
        print(
            f"{name:8} median {statistics.median(values):7,.0f} msg/s"
            f" ({statistics.median(values) / plain:.2f} of plain);"
            f" rounds {[round(v) for v in values]}; CPU us/msg: {cpu}"
        )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
