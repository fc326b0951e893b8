"""A RabbitMQ batch-mode consumer process for the SIGKILL tests (``tests/test_rabbit_batch.py``).

    python -m tests._rabbit_batch QUEUE BATCH_SIZE SLOW_MS

Runs the demo ledger handler in batch mode (``record_payments``, one transaction per batch) and
sleeps ``SLOW_MS`` inside each batch's transaction, after its writes, so that a SIGKILL lands
while a batch is uncommitted. Prints one JSON line once it consumes; exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Sequence

import asyncpg

from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import load_settings
from consumer_idem.transports.rabbit import RabbitRunner
from handlers.payments import LEDGER_SCOPE, record_payments


async def main(queue: str, batch_size: int, slow_ms: float) -> None:
    settings = load_settings()
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=1, max_size=8)
    assert pool is not None
    store = PostgresStore(pool)

    @idempotent_consumer(store, scope=LEDGER_SCOPE, key=header("idempotency-key"), batch=True)
    async def book(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(messages, conn)
        await asyncio.sleep(slow_ms / 1000)  # the batch's writes are in, not committed

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    runner = RabbitRunner(book, queue=queue, batch_size=batch_size, batch_wait=0.05)
    await runner.start()
    print(json.dumps({"event": "started"}), flush=True)
    try:
        await runner.run(stop)
    finally:
        await pool.close()
    print(json.dumps({"event": "stopped", **runner.stats.__dict__}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
