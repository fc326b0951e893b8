"""The idempotent payments consumer.

    python -m examples.payments_consumer --transport kafka|rabbit [--batch] [--emit DEST]

Consumes `payments.requests`; for each idempotency key it writes one `demo_ledger` row and adds
the amount to `demo_accounts`, in the same transaction as the idempotency record, then acks.
With `--emit DEST` it also publishes one `payment.booked` event per booked payment to the topic
or queue DEST through the transactional outbox: JSON with the payment's fields, the
`idempotency-key` header derived from the payment's key, sent right after the commit (or, after a
crash, by the relay of the next consumer).
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
from datetime import timedelta

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    create_pool,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import load_settings
from consumer_idem.outbox import outbox_for
from handlers.payments import (
    LEDGER_SCOPE,
    ensure_tables,
    parse_payment,
    record_payment,
    record_payments,
)

TOPIC = "payments.requests"


def emit_booked(conn: asyncpg.Connection, message: ConsumerMessage, destination: str) -> None:
    """The `payment.booked` event of a payment this unit books (batch mode: each message is its
    own unit). It leaves only if the booking commits; keyed by customer, so one customer's
    events keep their order on Kafka."""
    p = parse_payment(message)
    event = {
        "type": "payment.booked",
        "payment_id": p.payment_id,
        "customer_id": p.customer_id,
        "amount_cents": p.amount_cents,
        "currency": p.currency,
    }
    outbox_for(conn, message).publish(destination, event, key=p.customer_id)


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
    parser.add_argument(
        "--emit", metavar="DEST", default=None, help="publish payment.booked events to DEST"
    )
    parser.add_argument(
        "--relay-every", type=float, default=5.0, help="seconds between outbox relay passes"
    )
    parser.add_argument(
        "--relay-after",
        type=float,
        default=10.0,
        help="seconds a fresh outgoing message is left to its own process before a relay",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    settings = load_settings()
    # behind a transaction pooler (CONSUMER_IDEM_PG_POOLER=transaction): no statement cache
    pool = await create_pool(settings.pg_dsn, pooler=settings.pg_pooler, min_size=2, max_size=10)
    store = PostgresStore(pool, schema=settings.schema_name, pooler=settings.pg_pooler)
    store.outbox.relay_after = timedelta(seconds=args.relay_after)
    await store.migrate()
    await ensure_tables(pool)

    async def one(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await record_payment(message, conn)
        if args.emit:
            emit_booked(conn, message, args.emit)
        if args.slow_ms:
            await asyncio.sleep(args.slow_ms / 1000)

    async def many(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(messages, conn)
        for message in messages if args.emit else ():
            emit_booked(conn, message, args.emit)

    consumer = idempotent_consumer(
        store, scope=LEDGER_SCOPE, key=header("idempotency-key"), batch=args.batch
    )(many if args.batch else one)

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
            outbox_relay=args.relay_every,
        )
    else:
        from consumer_idem.transports.rabbit import RabbitRunner

        runner = RabbitRunner(consumer, queue=args.topic, outbox_relay=args.relay_every)
    print(json.dumps({"event": "started", "transport": args.transport}), flush=True)
    try:
        await runner.run(stop)  # type: ignore[attr-defined]
    finally:
        await pool.close()
    stats = runner.stats  # type: ignore[attr-defined]
    relayed = runner.outbox.relay.total.sent  # type: ignore[attr-defined]
    print(json.dumps({"event": "stopped", **stats.__dict__, "outbox_relayed": relayed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
