"""A FastStream Kafka batch subscriber process for the crash tests of
``tests/test_faststream_batch.py``, SIGKILLing itself at one step of its ``kill_at``-th batch.

    python -m tests._faststream_batch_child <topic> <group> <scope> <step> <kill_at>

Steps: ``handler`` (the effects written, not committed), ``committed`` (Postgres committed,
the Kafka offsets not yet), ``kafka`` (the Kafka offsets committed too); ``none`` never kills.
Prints ``{"event": "started"}``, and its stats as one JSON line when stopped with SIGTERM. The
DSN comes from ``CONSUMER_IDEM_PG_DSN``; the effects go to ``fs_effects``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaRouter

import consumer_idem.batch as batch_module
from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from consumer_idem.faststream import CurrentIdempotencyBatch, Idempotency, IdempotentConnection


class Killer:
    """Counts the batches reaching ``step`` and kills the process at the ``at``-th."""

    def __init__(self, step: str, at: int) -> None:
        self.step, self.at, self.seen = step, at, 0

    def reached(self, step: str) -> None:
        if step == self.step:
            self.seen += 1
            if self.seen == self.at:
                os.kill(os.getpid(), signal.SIGKILL)


def install(killer: Killer) -> None:
    """Fault points around the real components: each wraps the call it names."""
    original = batch_module.execute_and_commit

    async def execute_and_commit(conn: Any, sql: str) -> None:
        await original(conn, sql)
        killer.reached("committed")

    batch_module.execute_and_commit = execute_and_commit  # batch mode's COMMIT
    commit = AIOKafkaConsumer.commit

    async def kafka_commit(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        await commit(self, offsets)
        killer.reached("kafka")

    AIOKafkaConsumer.commit = kafka_commit  # type: ignore[method-assign]


async def main(topic: str, group: str, scope: str, step: str, kill_at: int) -> None:
    killer = Killer(step, kill_at)
    install(killer)
    pool = await asyncpg.create_pool(os.environ["CONSUMER_IDEM_PG_DSN"], min_size=1, max_size=4)
    assert pool is not None
    broker = KafkaBroker(
        load_settings().kafka_bootstrap, acks="all", enable_idempotence=True, logger=None
    )
    idem = Idempotency(
        PostgresStore(pool), broker=broker, scope=scope, key=header("idempotency-key")
    )
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber(
        topic,
        group_id=group,
        batch=True,
        max_records=25,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
    )
    async def handle(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> None:
        await conn.executemany(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
            [(scope, key, body["n"]) for key, body in zip(current.keys, bodies, strict=True)],
        )
        killer.reached("handler")
        await asyncio.sleep(0.01)

    broker.include_router(router)
    await broker.start()
    print(json.dumps({"event": "started"}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await broker.stop()
    await pool.close()
    print(json.dumps(dataclasses.asdict(idem.stats)), flush=True)


if __name__ == "__main__":
    topic, group, scope, step, kill_at = sys.argv[1:]
    asyncio.run(main(topic, group, scope, step, int(kill_at)))
