"""The idempotent payments consumer, its handler writing through a SQLAlchemy ``AsyncSession``.

    python -m examples.payments_consumer_sqlalchemy [--topic payments.requests]

The same contract and effect as ``examples.payments_consumer`` (Kafka): for each idempotency
key one ``demo_ledger`` row and the amount added to ``demo_accounts``. Here the handler gets a
session bound to the idempotency transaction (``with_session``), adds an ORM object and
upserts the balance through it; both commit with the idempotency record, then the offset is
committed. The store runs on the same engine (``EnginePool``): one pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Text, func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.sqlalchemy import engine_store, with_session
from examples.orders_sqlalchemy import DEFAULT_DSN, engine_for
from handlers.payments import LEDGER_SCOPE, ensure_tables, parse_payment

TOPIC = "payments.requests"


class Base(DeclarativeBase):
    pass


class LedgerEntry(Base):
    """A ``demo_ledger`` row (the table ``handlers.payments.ensure_tables`` creates)."""

    __tablename__ = "demo_ledger"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    payment_id: Mapped[str] = mapped_column(Text)
    customer_id: Mapped[str] = mapped_column(Text)
    amount_cents: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


class Account(Base):
    __tablename__ = "demo_accounts"

    customer_id: Mapped[str] = mapped_column(Text, primary_key=True)
    balance_cents: Mapped[int] = mapped_column(BigInteger, default=0)


async def record_payment(message: ConsumerMessage, session: AsyncSession) -> dict[str, str]:
    """One payment: a ledger entry and the balance, through the bound session."""
    p = parse_payment(message)  # a malformed request is poison: dead-lettered, never retried
    session.add(
        LedgerEntry(
            payment_id=p.payment_id,
            customer_id=p.customer_id,
            amount_cents=p.amount_cents,
            currency=p.currency,
        )
    )
    upsert = insert(Account).values(customer_id=p.customer_id, balance_cents=p.amount_cents)
    await session.execute(
        upsert.on_conflict_do_update(
            index_elements=[Account.customer_id],
            set_={"balance_cents": Account.balance_cents + upsert.excluded.balance_cents},
        )
    )
    return {"recorded": p.payment_id}


def ledger_consumer(store: PostgresStore, scope: str = LEDGER_SCOPE) -> IdempotentConsumer:
    """The idempotent consumer: ``record_payment`` with a session bound to each delivery's
    idempotency transaction."""
    return idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(
        with_session(record_payment)
    )


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", default=TOPIC, help="Kafka topic (default payments.requests)")
    parser.add_argument("--group", default="payments-ledger-sqlalchemy", help="consumer group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    from consumer_idem.transports.kafka import KafkaRunner

    engine = engine_for(os.environ.get("CONSUMER_IDEM_PG_DSN", DEFAULT_DSN))
    store = engine_store(engine, schema=os.environ.get("CONSUMER_IDEM_SCHEMA", "consumer_idem"))
    await store.migrate()
    async with store.connection() as conn:
        await ensure_tables(conn)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = KafkaRunner(ledger_consumer(store), topics=[args.topic], group_id=args.group)
    print(json.dumps({"event": "started", "transport": "kafka"}), flush=True)
    try:
        await runner.run(stop)
    finally:
        await engine.dispose()
    print(json.dumps({"event": "stopped", **runner.stats.__dict__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
