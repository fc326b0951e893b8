"""The idempotent payments consumer.

    python -m examples.payments_consumer --transport kafka|rabbit [--batch]

Consumes `payments.requests`; for each idempotency key it writes one `demo_ledger` row and adds
the amount to `demo_accounts`, in the same transaction as the idempotency record, then acks.
Runs until SIGTERM/SIGINT, then finishes what it holds, commits and exits 0. Killed with SIGKILL
it loses nothing: uncommitted work rolls back and is redelivered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.settings import load_settings
from handlers.payments import LEDGER_SCOPE, ensure_tables, record_payment, record_payments

TOPIC = "payments.requests"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["kafka", "rabbit"], required=True)
    parser.add_argument("--batch", action="store_true", help="one transaction per fetched batch")
    parser.add_argument("--topic", default=TOPIC, help="topic or queue (default payments.requests)")
    parser.add_argument("--group", default="payments-ledger", help="Kafka consumer group")
    parser.add_argument("--instance-id", default=None, help="Kafka static group membership id")
    parser.add_argument(
        "--slow-ms", type=float, default=0.0, help="sleep inside each handler (for crash tests)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    settings = load_settings()
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=2, max_size=10)
    assert pool is not None
    store = PostgresStore(pool, schema=settings.schema_name)
    await store.migrate()
    await ensure_tables(pool)

    async def one(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await record_payment(message, conn)
        if args.slow_ms:
            await asyncio.sleep(args.slow_ms / 1000)

    consumer = idempotent_consumer(
        store, scope=LEDGER_SCOPE, key=header("idempotency-key"), batch=args.batch
    )(record_payments if args.batch else one)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    runner: object
    if args.transport == "kafka":
        from consumer_idem.transports.kafka import KafkaRunner

        runner = KafkaRunner(
            consumer,
            topics=[args.topic],
            group_id=args.group,
            group_instance_id=args.instance_id,
            consumer_options={"session_timeout_ms": 10000, "heartbeat_interval_ms": 1000},
        )
    else:
        from consumer_idem.transports.rabbit import RabbitRunner

        runner = RabbitRunner(consumer, queue=args.topic)
    print(json.dumps({"event": "started", "transport": args.transport}), flush=True)
    try:
        await runner.run(stop)  # type: ignore[attr-defined]
    finally:
        await pool.close()
    stats = runner.stats  # type: ignore[attr-defined]
    print(json.dumps({"event": "stopped", **stats.__dict__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
