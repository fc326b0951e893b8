"""`make demo`: the payments demo on Kafka and on RabbitMQ.

For each transport: start the idempotent consumer, publish 2,000 payments of which 20% are sent
twice, kill the consumer with SIGKILL halfway and start it again (so the broker redelivers what
it had not acked yet), wait until the work is done, stop it with SIGTERM, and check the ledger:
one row per distinct key and every balance exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

import asyncpg

from consumer_idem.settings import load_settings
from examples.payments_producer import expected_balances, plan
from handlers.payments import ensure_tables

COUNT = 2000
DUPLICATE_RATE = 0.2
SEED = 7


async def start_consumer(transport: str, topic: str, group: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.payments_consumer",
        "--transport",
        transport,
        "--topic",
        topic,
        "--group",
        group,
        "--instance-id",
        f"{group}-1",
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # {"event": "started"}
    return proc


async def ledger_rows(pool: asyncpg.Pool, run_id: str) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM demo_ledger WHERE payment_id LIKE $1", f"{run_id}-pay-%"
        )
    )


async def wait_for(pool: asyncpg.Pool, run_id: str, target: int, budget: float) -> int:
    deadline = time.monotonic() + budget
    rows = 0
    while time.monotonic() < deadline:
        rows = await ledger_rows(pool, run_id)
        if rows >= target:
            await asyncio.sleep(1.0)  # anything beyond the target would be a double effect
            return await ledger_rows(pool, run_id)
        await asyncio.sleep(0.2)
    return rows


async def run_transport(pool: asyncpg.Pool, transport: str) -> dict[str, Any]:
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    topic = (
        f"payments.requests.{run_id}" if os.environ.get("DEMO_OWN_TOPIC") else "payments.requests"
    )
    group = f"payments-demo-{transport}"
    consumer = await start_consumer(transport, topic, group)
    producer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.payments_producer",
        "--transport",
        transport,
        "--count",
        str(COUNT),
        "--duplicate-rate",
        str(DUPLICATE_RATE),
        "--seed",
        str(SEED),
        "--run-id",
        run_id,
        "--topic",
        topic,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await producer.communicate()
    sent = json.loads(out.decode().strip().splitlines()[-1])

    await wait_for(pool, run_id, COUNT // 2, 120)
    consumer.kill()  # SIGKILL mid-run: whatever it had not acked is delivered again
    await consumer.wait()
    consumer = await start_consumer(transport, topic, group)
    rows = await wait_for(pool, run_id, COUNT, 180)
    consumer.send_signal(signal.SIGTERM)
    await asyncio.wait_for(consumer.communicate(), timeout=60)

    messages = plan(COUNT, DUPLICATE_RATE, SEED, run_id)
    expected = expected_balances(messages)
    actual = {
        r["customer_id"]: r["balance_cents"]
        for r in await pool.fetch(
            "SELECT customer_id, balance_cents FROM demo_accounts WHERE customer_id LIKE $1",
            f"{run_id}-%",
        )
    }
    return {
        "transport": transport,
        "messages_sent": sent["messages_sent"],
        "distinct_keys": sent["distinct_keys"],
        "ledger_rows": rows,
        "duplicates_absorbed": sent["messages_sent"] - rows,
        "balances_match": actual == expected,
        "consumer_exit_code": consumer.returncode,
    }


async def main() -> int:
    pool = await asyncpg.create_pool(load_settings().pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    ok = True
    try:
        await ensure_tables(pool)
        print(f"{'transport':<10} {'sent':>6} {'keys':>6} {'ledger':>7} {'absorbed':>9}  balances")
        for transport in ("kafka", "rabbit"):
            r = await run_transport(pool, transport)
            good = r["ledger_rows"] == r["distinct_keys"] and r["balances_match"]
            ok = ok and good and r["consumer_exit_code"] == 0
            print(
                f"{r['transport']:<10} {r['messages_sent']:>6} {r['distinct_keys']:>6} "
                f"{r['ledger_rows']:>7} {r['duplicates_absorbed']:>9}  "
                f"{'match' if r['balances_match'] else 'MISMATCH'}",
                flush=True,
            )
    finally:
        await pool.close()
    print("every payment booked exactly once" if ok else "DEMO FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
