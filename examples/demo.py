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

Any failure (a service down, a step over its time budget) stops every process the demo
started and prints one line naming the step that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import IO, Any

import asyncpg

from consumer_idem.cli.settings import load_settings
from examples.payments_producer import PARTITIONS, expected_balances, plan
from handlers.payments import LEDGER_SCOPE, ensure_tables

INTRO = """\
The payments demo, on Kafka and then on RabbitMQ. For each: a consumer books payments into a
ledger through consumer-idem; a producer publishes {count} payments, {dup}% of them twice.
Halfway through, the demo kills the consumer with SIGKILL (no clean shutdown: work it had
committed but not acked comes again) and starts a new one, to show that the redelivered
messages are absorbed, not booked twice. The columns:
  transport  the broker
  sent       messages published, planned duplicates included
  keys       distinct payments (idempotency keys) among them
  ledger     ledger rows booked: must equal keys
  absorbed   deliveries not booked again (sent - ledger): the duplicates consumer-idem caught
  balances   every customer's balance equals the sum of their distinct payments
  events     payment.booked events received (the outbox sends at least once)
  deduped    events left after deduplication by their idempotency-key header
  emitted    each booked payment emitted exactly once after deduplication
"""

COUNT = 2000
DUPLICATE_RATE = 0.2
SEED = 7
#: where the consumer emits its payment.booked events (the outbox's destination)
EMIT = "payments.booked"


class StepFailed(Exception):
    """A step of the demo failed; the message says how, in one line."""


class Steps:
    """The step the demo is at (named in a failure) and every process it started (all stopped
    on a failure, so none outlives the demo)."""

    def __init__(self) -> None:
        self.current = "starting"
        self.children: list[asyncio.subprocess.Process] = []
        self.logs: list[IO[bytes]] = []

    def log(self) -> IO[bytes]:
        """A new temporary file for a consumer's stderr (removed when closed)."""
        self.logs.append(tempfile.TemporaryFile())  # noqa: SIM115 (closed by stop_all)
        return self.logs[-1]

    def at(self, step: str) -> None:
        self.current = step

    def started(self, proc: asyncio.subprocess.Process) -> asyncio.subprocess.Process:
        self.children.append(proc)
        return proc

    async def stop_all(self) -> None:
        for proc in self.children:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), timeout=10)
        for log in self.logs:
            log.close()


STEPS = Steps()


async def start_consumer(
    transport: str, topic: str, group: str, emit: str
) -> asyncio.subprocess.Process:
    proc = STEPS.started(
        await asyncio.create_subprocess_exec(
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
            # a file, not a pipe: a consumer that logs much would block on a full pipe
            stderr=STEPS.log(),
        )
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    except TimeoutError:
        raise StepFailed("the consumer did not report started within 60 s") from None
    if not line:  # it exited before starting: its last words say why
        raise StepFailed(f"the consumer exited: {await last_line(proc)}")
    return proc


async def last_line(proc: asyncio.subprocess.Process) -> str:
    """The last line the consumer wrote on stderr (its error), briefly."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), timeout=10)
    STEPS.logs[-1].seek(0)
    err = STEPS.logs[-1].read().decode(errors="replace").strip().splitlines()
    return err[-1][:300] if err else f"exit status {proc.returncode}, nothing on stderr"


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
    STEPS.at(f"{transport}: preparing the events topic")
    marks = await kafka_marks(emit) if transport == "kafka" else {}
    STEPS.at(f"{transport}: starting the consumer")
    consumer = await start_consumer(transport, topic, group, emit)
    STEPS.at(f"{transport}: publishing the payments")
    producer = STEPS.started(
        await asyncio.create_subprocess_exec(
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
            stderr=asyncio.subprocess.PIPE,
        )
    )
    out, err = await producer.communicate()
    lines = out.decode().strip().splitlines()
    if producer.returncode != 0 or not lines:  # no summary line: it failed, say why
        said = err.decode(errors="replace").strip().splitlines()
        why = said[-1][:300] if said else f"exit status {producer.returncode}"
        raise StepFailed(f"the producer failed: {why}")
    sent = json.loads(lines[-1])

    STEPS.at(f"{transport}: booking the first half")
    if (half := await wait_for(pool, run_id, COUNT // 2, 120)) < COUNT // 2:
        raise StepFailed(f"{half} of {COUNT // 2} payments booked in 120 s")
    STEPS.at(f"{transport}: SIGKILL of the consumer and a new one")
    consumer.kill()  # SIGKILL mid-run: whatever it had not acked is delivered again
    await consumer.wait()
    consumer = await start_consumer(transport, topic, group, emit)
    STEPS.at(f"{transport}: booking the rest")
    rows = await wait_for(pool, run_id, COUNT, 180)
    deadline = time.monotonic() + 60  # events the kill left unsent: the relay's
    while time.monotonic() < deadline:
        if not await outbox_pending(pool, run_id):
            break
        await asyncio.sleep(0.2)
    STEPS.at(f"{transport}: stopping the consumer (SIGTERM)")
    consumer.send_signal(signal.SIGTERM)
    await asyncio.wait_for(consumer.communicate(), timeout=60)
    STEPS.at(f"{transport}: checking the ledger and the events")

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
    print(INTRO.format(count=COUNT, dup=round(DUPLICATE_RATE * 100)), flush=True)
    try:
        return await run_all()
    except Exception as exc:  # one line, the step that failed: no traceback wall
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"DEMO FAILED at step '{STEPS.current}': {type(exc).__name__}"
            + (f": {reason}" if reason else ""),
            flush=True,
        )
        return 1
    finally:
        await STEPS.stop_all()  # whatever ended the run, no consumer or producer outlives it


async def run_all() -> int:
    STEPS.at("connecting to PostgreSQL")
    pool = await asyncpg.create_pool(load_settings().pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    ok = True
    try:
        await ensure_tables(pool)
        print(
            f"{'transport':<10} {'sent':>6} {'keys':>6} {'ledger':>7} {'absorbed':>9}  balances"
            f"  {'events':>6} {'deduped':>7}  emitted",
            flush=True,
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
        else "DEMO FAILED: a column above says MISMATCH, or a consumer exited with an error",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
