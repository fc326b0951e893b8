"""A Kafka consumer process for the offsets-in-Postgres crash tests: the demo ledger effect
through ``KafkaRunner``, SIGKILLing itself at one step of its ``kill_at``-th unit of work.

    python -m tests._offsets_child <topic> <group> <scope> <one|batch> <step> <kill_at> <on|off>

Steps: ``fetched`` (records in hand, nothing done), ``handler`` (the effect written, not
committed), ``commit`` (about to send the COMMIT), ``committed`` (Postgres committed, Kafka
not yet), ``kafka`` (the Kafka offset committed too); ``none`` never kills. The last argument
turns ``offsets_in_postgres`` on or off. Prints ``{"event": "started"}``, and its stats as one
JSON line when stopped with SIGTERM. The DSN comes from ``CONSUMER_IDEM_PG_DSN``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.kafka import KafkaRunner
from handlers.payments import record_payment, record_payments

STEPS = ("fetched", "handler", "commit", "committed", "kafka")


class Killer:
    """Counts the units of work reaching ``step`` and kills the process at the ``at``-th."""

    def __init__(self, step: str, at: int) -> None:
        self.step = step
        self.at = at
        self.seen = 0

    def reached(self, step: str) -> None:
        if step != self.step:
            return
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def install(killer: Killer, runner: KafkaRunner) -> None:
    """Fault points around the real components (no stand-ins): each wraps the call it names."""
    import consumer_idem.batch as batch_module
    import consumer_idem.stores.postgres.fast_path as fast_path_module

    def around_commit(module: Any) -> None:
        original = module.execute_and_commit

        async def execute_and_commit(conn: Any, sql: str) -> None:
            killer.reached("commit")
            await original(conn, sql)
            killer.reached("committed")

        module.execute_and_commit = execute_and_commit

    around_commit(batch_module)  # batch mode's COMMIT
    around_commit(fast_path_module)  # one message per transaction: result + COMMIT

    kafka = runner._kafka
    commit = kafka.commit

    async def kafka_commit(*args: Any, **kwargs: Any) -> None:
        await commit(*args, **kwargs)
        killer.reached("kafka")

    kafka.commit = kafka_commit  # type: ignore[method-assign]

    consumer = runner.consumer
    process_batch = consumer.process_batch

    async def fetched(messages: Sequence[ConsumerMessage], *args: Any) -> Any:
        killer.reached("fetched")
        return await process_batch(messages, *args)

    consumer.process_batch = fetched  # type: ignore[method-assign]


async def main(topic: str, group: str, scope: str, mode: str, step: str, at: str, pg: str) -> None:
    settings = load_settings()
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    store = PostgresStore(pool)
    killer = Killer(step, int(at))

    async def one(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await record_payment(message, conn)
        killer.reached("handler")

    async def many(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(messages, conn)
        killer.reached("handler")

    batch = mode == "batch"
    consumer = idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=batch, backoff=(0.1, 0.5)
    )(many if batch else one)
    runner = KafkaRunner(
        consumer,
        topics=[topic],
        group_id=group,
        group_instance_id=f"{group}-child",  # a restart takes the partition back at once
        max_records=5,  # several transactions (and Kafka commits) in a short topic
        chunk=5,
        offsets_in_postgres=pg == "on",
        outbox_relay=None,
        consumer_options={"session_timeout_ms": 6000, "heartbeat_interval_ms": 500},
    )
    if step != "none":
        install(killer, runner)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await runner.start()
    print(json.dumps({"event": "started"}), flush=True)
    try:
        await runner.run(stop)
    finally:
        await pool.close()
    print(json.dumps({"event": "stopped", **runner.stats.__dict__}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:8]))
