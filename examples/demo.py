"""`make demo`: the payments demo on Kafka and on RabbitMQ.

For each transport: start the idempotent consumer, publish 2,000 payments of which 20% are sent
twice, kill the consumer with SIGKILL halfway and start it again (so the broker redelivers what
it had not acked yet), wait until the work is done, stop it with SIGTERM, and check the ledger:
one row per distinct key and every balance exact.

The consumer also emits a `payment.booked` event per booked payment to `payments.booked`
through the transactional outbox (`--emit`). The SIGKILL can land between a commit and its
dispatch: the next consumer's relay sends those. So events arrive at least once; the demo
checks that, deduplicated by their `idempotency-key` header, every booked payment was emitted
exactly once, and no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections import Counter
from typing import Any

import asyncpg

from consumer_idem.cli.settings import load_settings
from examples.payments_producer import PARTITIONS, expected_balances, plan
from handlers.payments import LEDGER_SCOPE, ensure_tables

COUNT = 2000
DUPLICATE_RATE = 0.2
SEED = 7
#: where the consumer emits its payment.booked events (the outbox's destination)
EMIT = "payments.booked"


async def start_consumer(
    transport: str, topic: str, group: str, emit: str
) -> asyncio.subprocess.Process:
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
        "--emit",
        emit,
        # a killed consumer's unsent events: the next one's relay sends them within seconds
        "--relay-every",
        "1",
        "--relay-after",
        "2",
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


async def outbox_pending(pool: asyncpg.Pool, run_id: str) -> int:
    """The run's events committed with their payment and not yet confirmed by the broker."""
    table = f'"{load_settings().schema_name}".outbox_messages'
    return int(
        await pool.fetchval(
            f"SELECT count(*) FROM {table} WHERE status = 'pending' AND scope = $1"
            " AND unit_key LIKE $2",
            LEDGER_SCOPE,
            f"{run_id}:%",
        )
    )


async def kafka_marks(topic: str) -> dict[Any, int]:
    """The end offset of each partition of ``topic`` (created if missing): where this run's
    events start."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    bootstrap = load_settings().kafka_bootstrap
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    partitions = [TopicPartition(topic, p["partition"]) for p in described[0]["partitions"]]
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await probe.start()
    try:
        return dict(await probe.end_offsets(partitions))
    finally:
        await probe.stop()


async def kafka_events(marks: dict[Any, int]) -> list[tuple[str, bytes]]:
    """(idempotency-key, body) of every event written after ``marks``."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=load_settings().kafka_bootstrap, enable_auto_commit=False
    )
    await consumer.start()
    events: list[tuple[str, bytes]] = []
    try:
        ends = await consumer.end_offsets(list(marks))
        consumer.assign(list(marks))
        for tp, offset in marks.items():
            consumer.seek(tp, offset)
        deadline = time.monotonic() + 60

        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in marks])

        while await behind():
            if time.monotonic() > deadline:
                raise TimeoutError("reading the emitted events took too long")
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    key = dict(r.headers or ()).get("idempotency-key", b"").decode()
                    events.append((key, r.value or b""))
    finally:
        await consumer.stop()
    return events


async def rabbit_events(queue: str) -> list[tuple[str, bytes]]:
    """(idempotency-key, body) of every event in ``queue``, taking them off it."""
    import aio_pika

    connection = await aio_pika.connect(load_settings().amqp_url)
    events: list[tuple[str, bytes]] = []
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(
            queue, durable=True, arguments={"x-queue-type": "quorum"}
        )
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            key = (message.headers or {}).get("idempotency-key", "")
            events.append((str(key), message.body))
    finally:
        await connection.close()
    return events


def booked_once(events: list[tuple[str, bytes]], run_id: str, booked: set[str]) -> dict[str, Any]:
    """The events of this run, deduplicated by their header: exactly one per booked payment?"""
    first: dict[str, str] = {}  # idempotency-key -> payment_id
    received = 0
    for key, body in events:
        payment_id = str(json.loads(body).get("payment_id", ""))
        if not payment_id.startswith(f"{run_id}-pay-"):
            continue  # an earlier run's
        received += 1
        first.setdefault(key, payment_id)
    per_payment = Counter(first.values())
    return {
        "events_received": received,
        "events_distinct": len(first),
        "emitted_once": set(per_payment) == booked and set(per_payment.values()) == {1},
    }


async def run_transport(pool: asyncpg.Pool, transport: str) -> dict[str, Any]:
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    own = bool(os.environ.get("DEMO_OWN_TOPIC"))
    topic = f"payments.requests.{run_id}" if own else "payments.requests"
    emit = f"{EMIT}.{run_id}" if own else EMIT
    group = f"payments-demo-{transport}"
    marks = await kafka_marks(emit) if transport == "kafka" else {}
    consumer = await start_consumer(transport, topic, group, emit)
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
    consumer = await start_consumer(transport, topic, group, emit)
    rows = await wait_for(pool, run_id, COUNT, 180)
    deadline = time.monotonic() + 60  # events the kill left unsent: the relay's
    while time.monotonic() < deadline:
        if not await outbox_pending(pool, run_id):
            break
        await asyncio.sleep(0.2)
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
    booked = {
        r["payment_id"]
        for r in await pool.fetch(
            "SELECT DISTINCT payment_id FROM demo_ledger WHERE payment_id LIKE $1",
            f"{run_id}-pay-%",
        )
    }
    events = await (kafka_events(marks) if transport == "kafka" else rabbit_events(emit))
    return {
        "transport": transport,
        "messages_sent": sent["messages_sent"],
        "distinct_keys": sent["distinct_keys"],
        "ledger_rows": rows,
        "duplicates_absorbed": sent["messages_sent"] - rows,
        "balances_match": actual == expected,
        "consumer_exit_code": consumer.returncode,
        **booked_once(events, run_id, booked),
    }


async def main() -> int:
    pool = await asyncpg.create_pool(load_settings().pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    ok = True
    try:
        await ensure_tables(pool)
        print(
            f"{'transport':<10} {'sent':>6} {'keys':>6} {'ledger':>7} {'absorbed':>9}  balances"
            f"  {'events':>6} {'deduped':>7}  emitted"
        )
        for transport in ("kafka", "rabbit"):
            r = await run_transport(pool, transport)
            good = r["ledger_rows"] == r["distinct_keys"] and r["balances_match"]
            ok = ok and good and r["consumer_exit_code"] == 0 and r["emitted_once"]
            print(
                f"{r['transport']:<10} {r['messages_sent']:>6} {r['distinct_keys']:>6} "
                f"{r['ledger_rows']:>7} {r['duplicates_absorbed']:>9}  "
                f"{'match' if r['balances_match'] else 'MISMATCH':<8}  "
                f"{r['events_received']:>6} {r['events_distinct']:>7}  "
                f"{'once each' if r['emitted_once'] else 'MISMATCH'}",
                flush=True,
            )
    finally:
        await pool.close()
    print(
        "every payment booked exactly once, its event emitted once after deduplication"
        if ok
        else "DEMO FAILED",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
