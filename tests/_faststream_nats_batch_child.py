"""A FastStream JetStream batch pull subscriber process for the crash test of
``tests/test_faststream_nats_chaos.py``: its handler SIGKILLs the process whenever the batch it
was given holds a body marked ``poison`` (after writing the batch's effects, before the commit).

    python -m tests._faststream_nats_batch_child <subject> <scope> <max_deliveries>

Prints ``{"event": "started"}``, and its stats as one JSON line when stopped with SIGTERM. The
DSN comes from ``CONSUMER_IDEM_PG_DSN``; the effects go to ``fs_effects``. The subject's stream
(named after it, with its ``.dlq``) and its durable consumer ``worker`` are shared by every run.
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
from faststream import AckPolicy
from faststream.nats import ConsumerConfig, JStream, NatsBroker, NatsRouter, PullSub

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import load_settings
from consumer_idem.faststream import CurrentIdempotencyBatch, Idempotency, IdempotentConnection

#: seconds JetStream waits for an ack before it redelivers a killed child's messages
ACK_WAIT = 1.5


async def main(subject: str, scope: str, max_deliveries: int) -> None:
    pool = await asyncpg.create_pool(os.environ["CONSUMER_IDEM_PG_DSN"], min_size=1, max_size=8)
    assert pool is not None
    broker = NatsBroker(load_settings().nats_url, logger=None)
    idem = Idempotency(
        PostgresStore(pool),
        broker=broker,
        scope=scope,
        backoff=(0.05, 0.5),
        max_deliveries=max_deliveries,
    )
    router = NatsRouter(middlewares=[idem])

    @router.subscriber(
        subject,
        stream=JStream(subject, subjects=[subject, f"{subject}.dlq"]),
        durable="worker",
        pull_sub=PullSub(8, timeout=0.5, batch=True),
        config=ConsumerConfig(ack_wait=ACK_WAIT),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(
        bodies: list[dict[str, Any]],
        conn: IdempotentConnection,
        current: CurrentIdempotencyBatch,
    ) -> None:
        await conn.executemany(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
            [(scope, key, body["n"]) for key, body in zip(current.keys, bodies, strict=True)],
        )
        if any(body.get("poison") for body in bodies):
            os.kill(os.getpid(), signal.SIGKILL)

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
    subject, scope, limit = sys.argv[1:]
    asyncio.run(main(subject, scope, int(limit)))
