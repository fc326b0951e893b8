"""A RabbitMQ batch-mode consumer process that a poison message kills (test_rabbit_budget).

    python -m tests._rabbit_poison QUEUE MAX_DELIVERIES

Books payments with the demo ledger handler in batch mode; a batch holding a message with the
header ``poison`` ends the process at once (``os._exit``), as a crash in native code or an
out-of-memory kill would: nothing is rolled back politely, nothing is acked; one with the header
``slow`` takes 1.5 s to book. Prints one JSON line once it consumes; exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.rabbit import RabbitRunner
from handlers.payments import LEDGER_SCOPE, record_payments


async def main(queue: str, max_deliveries: int) -> None:
    settings = load_settings()
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=1, max_size=8)
    assert pool is not None
    store = PostgresStore(pool)

    @idempotent_consumer(store, scope=LEDGER_SCOPE, key=header("idempotency-key"), batch=True)
    async def book(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        if any("poison" in m.headers for m in messages):
            os._exit(3)
        await record_payments(messages, conn)
        if any("slow" in m.headers for m in messages):
            await asyncio.sleep(1.5)  # a slow good message: other deliveries arrive meanwhile
        await asyncio.sleep(0.05)  # a little work: deliveries beside the poison are in flight

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = RabbitRunner(
        book, queue=queue, batch_size=50, batch_wait=0.2, max_deliveries=max_deliveries
    )
    await runner.start()
    print(json.dumps({"event": "started"}), flush=True)
    try:
        await runner.run(stop)
    finally:
        await pool.close()
    print(json.dumps({"event": "stopped", **runner.stats.__dict__}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
