"""A FastStream Confluent Kafka consumer process for the SIGKILL test of
``tests/test_faststream_confluent.py``: an idempotent subscriber (one record at a time, or
batches) writing one ``fs_effects`` row per key, until it is killed or stopped.

    python -m tests._faststream_confluent_child <topic> <group> <scope> single|batch <kill_at>

With ``kill_at`` > 0 it SIGKILLs itself inside its ``kill_at``-th handler call, its effects
written but not committed, after holding the record longer than an auto-commit interval (so
a consumer that committed on fetch would lose it). Prints ``{"event": "started"}`` once its
broker started; on SIGTERM it stops its broker. The DSN comes from ``CONSUMER_IDEM_PG_DSN``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import asyncpg
from faststream import AckPolicy
from faststream.confluent import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, header
from consumer_idem.cli.settings import load_settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotentConnection,
)


class Killer:
    """Kills the process inside its ``at``-th handler call (0: never)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    async def reached(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            await asyncio.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)


async def main(topic: str, group: str, scope: str, kind: str, kill_at: int) -> None:
    killer = Killer(kill_at)
    pool = await asyncpg.create_pool(os.environ["CONSUMER_IDEM_PG_DSN"], min_size=1, max_size=4)
    assert pool is not None
    broker = KafkaBroker(
        load_settings().kafka_bootstrap,
        acks="all",
        # one static member: a restarted child takes the killed one's place at once, without
        # waiting for its session to expire
        config={
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "group.instance.id": f"{group}-member",
        },
        logger=None,
    )
    idem = Idempotency(
        PostgresStore(pool), broker=broker, scope=scope, key=header("idempotency-key")
    )
    router = KafkaRouter(middlewares=[idem])
    subscribe = router.subscriber(
        topic,
        group_id=group,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
        **({"batch": True, "max_records": 20} if kind == "batch" else {}),
    )
    if kind == "batch":

        async def handle_batch(
            bodies: list[dict[str, Any]],
            conn: IdempotentConnection,
            current: CurrentIdempotencyBatch,
        ) -> None:
            await conn.executemany(
                "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
                [(scope, key, body["n"]) for key, body in zip(current.keys, bodies, strict=True)],
            )
            await killer.reached()
            await asyncio.sleep(0.05)  # paced, so a kill from outside lands mid-run

        subscribe(handle_batch)
    else:

        async def handle(
            body: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
        ) -> None:
            await conn.execute(
                "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
                scope,
                current.key,
                body["n"],
            )
            await killer.reached()

        subscribe(handle)
    broker.include_router(router)
    await broker.start()
    print(json.dumps({"event": "started"}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await broker.stop()
    await pool.close()


if __name__ == "__main__":
    topic, group, scope, kind, kill_at = sys.argv[1:]
    asyncio.run(main(topic, group, scope, kind, int(kill_at)))
