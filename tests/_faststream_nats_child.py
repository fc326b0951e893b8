"""A FastStream JetStream pull subscriber process for the crash test of
``tests/test_faststream_nats_chaos.py``, SIGKILLing itself at one step of its ``kill_at``-th
message.

    python -m tests._faststream_nats_child <subject> <scope> <step> <kill_at> [max_deliveries]

Steps: ``handler`` (the effect written, not committed), ``committed`` (Postgres committed, the
JetStream ack not sent), ``acked`` (acked too); ``none`` never kills. Prints
``{"event": "started"}``, and its stats as one JSON line when stopped with SIGTERM. The DSN
comes from ``CONSUMER_IDEM_PG_DSN``; the effects go to ``fs_effects``. The subject's stream
(named after it) and its durable consumer ``worker`` are shared by every run of the test.
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
from faststream import AckPolicy, StreamMessage
from faststream.nats import ConsumerConfig, JStream, NatsBroker, NatsRouter, PullSub

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import load_settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentConnection
from consumer_idem.faststream.nats_side import _Nats

#: seconds JetStream waits for an ack before it redelivers a killed child's messages
ACK_WAIT = 1.5


class Killer:
    """Counts the messages reaching ``step`` and kills the process at the ``at``-th."""

    def __init__(self, step: str, at: int) -> None:
        self.step, self.at, self.seen = step, at, 0

    def reached(self, step: str) -> None:
        if step == self.step:
            self.seen += 1
            if self.seen == self.at:
                os.kill(os.getpid(), signal.SIGKILL)


def install(killer: Killer) -> None:
    """Fault points around the real ack: before it (committed) and after it (acked)."""
    original = _Nats.ack

    async def ack(self: _Nats, message: StreamMessage[Any]) -> None:
        killer.reached("committed")
        await original(self, message)
        killer.reached("acked")

    _Nats.ack = ack  # type: ignore[method-assign]


async def main(subject: str, scope: str, step: str, kill_at: int, max_deliveries: int = 20) -> None:
    killer = Killer(step, kill_at)
    install(killer)
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
        pull_sub=PullSub(batch_size=8, timeout=0.5),
        config=ConsumerConfig(ack_wait=ACK_WAIT),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await conn.execute(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
            scope,
            current.key,
            data["n"],
        )
        killer.reached("handler")
        await asyncio.sleep(0.005)

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
    subject, scope, step, kill_at, *limit = sys.argv[1:]
    asyncio.run(main(subject, scope, step, int(kill_at), *(int(n) for n in limit)))
