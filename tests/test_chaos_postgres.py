"""Infrastructure chaos: every Postgres backend of the database is terminated, again and again,
while the payments demo consumer runs on a real broker, on top of SIGKILLs of the consumer.

For each transport (Kafka, RabbitMQ):

1. SIGKILL cycles: a consumer process starts, its database connections are all terminated
   (``pg_terminate_backend`` of every backend of the database) once or twice while it works,
   then it is SIGKILLed. Repeated ``KILL_CYCLES`` times.
2. The survivor: one more consumer, struck ``FINAL_STRIKES`` times while it works; it must ride
   out every strike, finish the whole stream and stop cleanly (SIGTERM, exit 0).
3. A drainer, only if the survivor left deliveries unsettled at its graceful stop (a duplicate
   parked in a retry wait is handed back to the broker, which is correct): it settles them.

Then the invariants: every distinct payment booked exactly once (ledger rows, no doubles,
balances exact), every idempotency record of the run ``completed`` (the ledger handler has no
ambiguous step: nothing may end ``unknown``, ``failed_retryable`` or ``in_progress``), nothing
dead-lettered, and nothing left unsettled on the broker (Kafka: the group's committed offsets at
the end of every partition; RabbitMQ: the queue empty once no consumer holds a delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings
from consumer_idem.consumer import DEAD_LETTER_REASON
from examples.payments_producer import PARTITIONS, plan, send_kafka, send_rabbit
from handlers.payments import LEDGER_SCOPE
from tests._outbox import sent_keys
from tests._payments import assert_exactly_once, ledger_count, read_topic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

T = TypeVar("T")

COUNT = 2000
DUPLICATE_RATE = 0.1
KILL_CYCLES = 5
FINAL_STRIKES = 5

#: exactly the statement of the brief: every backend of the database but the caller's own
TERMINATE_ALL = (
    "SELECT pg_terminate_backend(pid) AS killed, xact_start IS NOT NULL AS in_tx"
    " FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
)

#: the header a dead-lettered copy carries its error text in (issue 13, finding 6)
DEAD_LETTER_ERROR = "x-dead-letter-error"

#: what a connection killed under the test's own feet raises (the pool reconnects on next use);
#: asyncpg's InternalClientError: a query sent between the server's FATAL and the socket's EOF
DB_GONE = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)


async def resilient(call: Callable[[], Awaitable[T]], attempts: int = 20) -> T:
    """Run a read of the test's own pool, again if a strike killed its connection."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except DB_GONE:
            await asyncio.sleep(0.1)
    return await call()


@dataclass
class Terminator:
    """Terminates every backend of one database from a connection of its own (excluded)."""

    conn: asyncpg.Connection
    database: str
    strikes: list[tuple[float, int, int]] = field(default_factory=list)  #: (at, killed, in_tx)

    @classmethod
    async def open(cls, dsn: str) -> Terminator:
        conn = await asyncpg.connect(dsn, timeout=10)
        database = await conn.fetchval("SELECT current_database()")
        return cls(conn, database)

    async def strike(self) -> int:
        rows = await self.conn.fetch(TERMINATE_ALL, self.database)
        killed = sum(1 for r in rows if r["killed"])
        in_tx = sum(1 for r in rows if r["killed"] and r["in_tx"])
        self.strikes.append((time.monotonic(), killed, in_tx))
        return killed

    @property
    def killed(self) -> int:
        return sum(k for _, k, _ in self.strikes)

    @property
    def killed_in_tx(self) -> int:
        return sum(t for _, _, t in self.strikes)

    async def close(self) -> None:
        await self.conn.close()


class Consumer:
    """One ``examples.payments_consumer`` process; its stderr (the library's warnings) in a file
    so that a failure can show what the process said."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log

    @classmethod
    async def start(
        cls, pg_dsn: str, transport: str, topic: str, extra: list[str], log: Path
    ) -> Consumer:
        env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
        with log.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "examples.payments_consumer",
                "--transport",
                transport,
                "--topic",
                topic,
                *extra,
                cwd=ROOT,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        consumer = cls(proc, log)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        if not line:
            await proc.wait()
            raise AssertionError(f"the consumer died while starting\n{consumer.tail()}")
        assert json.loads(line)["event"] == "started", line
        return consumer

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no stderr)"
        return "\n".join(text[-lines:])

    def assert_alive(self, when: str) -> None:
        if not self.alive:
            raise AssertionError(
                f"the consumer exited ({self.proc.returncode}) {when}; stderr:\n{self.tail()}"
            )

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> dict[str, Any]:
        """SIGTERM: a graceful stop must exit 0 and print its stats."""
        self.assert_alive("before its graceful stop")
        self.proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(self.proc.communicate(), timeout=60)
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}; stderr:\n{self.tail()}"
        return dict(json.loads(out.decode().strip().splitlines()[-1]))


@dataclass
class Transport:
    """What differs between Kafka and RabbitMQ: the consumer's arguments and how to tell that
    every delivery was settled and nothing was dead-lettered."""

    name: str
    topic: str
    extra: list[str]
    unsettled: Callable[[], Awaitable[int]]  #: deliveries not yet acked / committed
    dead_lettered: Callable[[], Awaitable[int]]  #: copies in the dead-letter destination
    #: (reason, error) of each dead-lettered copy, read when one was found
    dead_letters: Callable[[], Awaitable[list[tuple[str, str]]]]

    async def assert_nothing_dead_lettered(self) -> None:
        if await self.dead_lettered():
            letters = await self.dead_letters()
            reasons = Counter(reason for reason, _ in letters)
            errors = Counter(error for _, error in letters if error).most_common(3)
            raise AssertionError(
                f"{len(letters)} good payments were dead-lettered (lost to the ledger): "
                f"reasons {dict(reasons)}; most common errors {errors}"
            )


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    return "" if value is None else str(value)


async def kafka_transport(
    settings: Settings, kafka_admin: Any, topic: str, run_id: str
) -> Transport:
    group = run_id
    dlq = f"{topic}.dlq"
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]

    async def end_offsets(partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        probe = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
        await probe.start()
        try:
            return dict(await probe.end_offsets(partitions))
        finally:
            await probe.stop()

    ends = await end_offsets(tps)

    async def unsettled() -> int:
        committed = await kafka_admin.list_consumer_group_offsets(group)
        behind = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else 0
            behind += ends[tp] - done
        return behind

    async def dead_lettered() -> int:
        if dlq not in await kafka_admin.list_topics():  # (no metadata request: no auto-create)
            return 0
        described = await kafka_admin.describe_topics([dlq])
        parts = [TopicPartition(dlq, p["partition"]) for p in described[0]["partitions"]]
        return sum((await end_offsets(parts)).values())

    async def dead_letters() -> list[tuple[str, str]]:
        records = await read_topic(settings.kafka_bootstrap, dlq, await dead_lettered())
        letters = []
        for record in records:
            headers = dict(record.headers or ())
            letters.append(
                (
                    _text(headers.get(DEAD_LETTER_REASON)),
                    _text(headers.get(DEAD_LETTER_ERROR)),
                )
            )
        return letters

    # static membership: a restarted process takes its partitions back at once
    extra = ["--group", group, "--instance-id", f"{run_id}-1", "--slow-ms", "20"]
    return Transport("kafka", topic, extra, unsettled, dead_lettered, dead_letters)


@contextlib.asynccontextmanager
async def amqp_channel(url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    """A channel on a connection of its own, opened again if the broker dropped it: other
    tests on the same broker restart it (the consumer under test reconnects by itself)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            connection = await aio_pika.connect(url, timeout=5)
            break
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


def rabbit_transport(url: str, queue: str) -> Transport:
    dlq = f"{queue}.dlq"

    async def ready(name: str) -> int:
        async with amqp_channel(url) as channel:
            declared = await channel.declare_queue(name, passive=True)
            return int(declared.declaration_result.message_count or 0)

    async def unsettled() -> int:
        # ready messages only: call it when no consumer holds a delivery (after a stop)
        return await ready(queue)

    async def dead_lettered() -> int:
        return await ready(dlq)

    async def dead_letters() -> list[tuple[str, str]]:
        letters = []
        async with amqp_channel(url) as channel:  # left unacked: back to the dead-letter queue
            declared = await channel.declare_queue(dlq, passive=True)
            while (message := await declared.get(no_ack=False, fail=False)) is not None:
                headers = message.headers or {}
                letters.append(
                    (
                        _text(headers.get(DEAD_LETTER_REASON)),
                        _text(headers.get(DEAD_LETTER_ERROR)),
                    )
                )
        return letters

    # 10 pooled connections, 40 ms inside each transaction: ~250 msg/s, so strikes land mid-run
    extra = ["--slow-ms", "40"]
    return Transport("rabbit", queue, extra, unsettled, dead_lettered, dead_letters)


async def run_under_strikes(
    transport: Transport,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    run_id: str,
    distinct: int,
    logs: Path,
) -> tuple[Terminator, dict[str, Any], list[str]]:
    """Phases 1-3 of the module docstring. Returns the terminator (its strikes), the
    survivor's stats and a timeline of the phases."""
    rng = random.Random(run_id)
    timeline: list[str] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:5.1f}s {what}")

    async def booked() -> int:
        return await resilient(lambda: ledger_count(pg_pool, run_id))

    terminator = await Terminator.open(pg_dsn)
    consumers: list[Consumer] = []

    async def start(n: int) -> Consumer:
        c = await Consumer.start(
            pg_dsn, transport.name, transport.topic, transport.extra, logs / f"consumer-{n}.log"
        )
        consumers.append(c)
        return c

    try:
        # 1. SIGKILL cycles, each consumer struck once or twice while it works
        for cycle in range(KILL_CYCLES):
            proc = await start(cycle)
            for _ in range(rng.randint(1, 2)):
                await asyncio.sleep(rng.uniform(0.2, 0.5))
                await terminator.strike()
            await asyncio.sleep(rng.uniform(0.1, 0.4))
            proc.assert_alive("under strikes, before its SIGKILL")
            await proc.kill()
        done = await booked()
        mark(f"{KILL_CYCLES} SIGKILLs, {len(terminator.strikes)} strikes: {done} booked")
        await transport.assert_nothing_dead_lettered()
        assert 0 < done < distinct, f"the kills must land mid-run (booked {done})"

        # 2. the survivor: struck repeatedly, must finish everything and stop cleanly
        survivor = await start(KILL_CYCLES)
        for _ in range(FINAL_STRIKES):
            await asyncio.sleep(rng.uniform(0.4, 0.8))
            await terminator.strike()
            survivor.assert_alive("after a strike")
        done = await booked()
        mark(f"{len(terminator.strikes)} strikes in all: {done} booked")
        assert done < distinct, "the survivor's strikes must land mid-run"

        deadline = time.monotonic() + 60
        next_look = 0.0
        while True:
            look = time.monotonic() > next_look  # a lost payment fails now, not at the deadline
            # Kafka commits an offset only after its Postgres commit: read the offsets first
            behind = await transport.unsettled() if look and transport.name == "kafka" else None
            done = await booked()
            if done >= distinct:
                break
            survivor.assert_alive("before the stream was done")
            if look:
                await transport.assert_nothing_dead_lettered()
                if behind == 0:
                    raise AssertionError(
                        f"every offset is committed but only {done} of {distinct} payments are"
                        " booked: deliveries were acked without their effect"
                    )
                next_look = time.monotonic() + 1.0
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"only {done} of {distinct} payments booked 60 s after the last strike;"
                    f" survivor stderr:\n{survivor.tail()}"
                )
            await asyncio.sleep(0.2)
        mark("every payment booked")
        if transport.name == "kafka":  # committed offsets are visible: wait for all of them
            while await transport.unsettled() and time.monotonic() < deadline:
                survivor.assert_alive("before its offsets were committed")
                await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # anything still arriving would be a double
        stats = await survivor.stop()
        mark(f"survivor stopped: {stats}")

        # 3. a graceful stop hands back deliveries parked in a retry wait: settle them
        left = await transport.unsettled()
        if left:
            mark(f"{left} deliveries handed back at the stop: draining")
            drainer = await start(KILL_CYCLES + 1)
            drain_deadline = time.monotonic() + 30
            while await transport.unsettled() and time.monotonic() < drain_deadline:
                drainer.assert_alive("while draining")
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)  # an ack in flight
            await drainer.stop()
            mark("drained")
        return terminator, stats, timeline
    finally:
        for c in consumers:
            if c.alive:
                await c.kill()
        await terminator.close()


async def assert_every_message_settled_once(
    transport: Transport,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    run_id: str,
    messages: list[Any],
) -> None:
    await assert_exactly_once(pg_pool, run_id, messages)
    # the ledger handler has no ambiguous step: every key ends completed, none unknown (so no
    # reconciliation notice is owed), failed_retryable or in_progress
    rows = await pg_pool.fetch(
        f"SELECT status, count(*) AS n FROM {store.table}"
        " WHERE scope = $1 AND key LIKE $2 GROUP BY status",
        LEDGER_SCOPE,
        f"{run_id}:%",
    )
    assert {r["status"]: r["n"] for r in rows} == {"completed": len({m.key for m in messages})}
    await transport.assert_nothing_dead_lettered()
    assert await transport.unsettled() == 0, "deliveries left unsettled on the broker"


async def strike_a_run(
    transport: Transport,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    run_id: str,
    messages: list[Any],
    logs: Path,
) -> None:
    started = time.monotonic()
    distinct = len({m.key for m in messages})
    terminator, stats, timeline = await run_under_strikes(
        transport, pg_dsn, pg_pool, run_id, distinct, logs
    )
    print(f"\n[{transport.name}] " + "\n".join(timeline))
    # the survivor did real work through the strikes, and parked or dead-lettered nothing
    assert stats["executed"] > 0, stats
    assert stats["dead_lettered"] == 0 and stats["reconcile_published"] == 0, stats
    # the strikes must have hit real work: connections killed inside open transactions
    assert len(terminator.strikes) >= KILL_CYCLES + FINAL_STRIKES
    assert all(killed > 0 for _, killed, _ in terminator.strikes), terminator.strikes
    assert terminator.killed_in_tx > 0, terminator.strikes
    print(
        f"[{transport.name}] {len(terminator.strikes)} strikes killed {terminator.killed}"
        f" backends ({terminator.killed_in_tx} inside a transaction) in"
        f" {time.monotonic() - started:.1f}s"
    )
    # a strike kills the test's own pooled connections too: let the pool notice
    await resilient(lambda: pg_pool.fetchval("SELECT 1"))
    await assert_every_message_settled_once(transport, pg_pool, store, run_id, messages)


@pytest.mark.timeout(150)
async def test_kafka_postgres_backends_terminated_during_a_run_lose_and_double_nothing(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_admin: Any,
    kafka_topic_factory: Any,
    tmp_path: Path,
) -> None:
    run_id = f"pgchaos{uuid.uuid4().hex[:6]}"
    messages = plan(COUNT, DUPLICATE_RATE, 5, run_id)
    topic = await kafka_topic_factory("pgchaos", partitions=PARTITIONS)
    await send_kafka(messages, topic)
    transport = await kafka_transport(settings, kafka_admin, topic, run_id)
    try:
        await strike_a_run(transport, pg_dsn, pg_pool, store, run_id, messages, tmp_path)
    finally:
        with contextlib.suppress(Exception):
            if f"{topic}.dlq" in await kafka_admin.list_topics():
                await kafka_admin.delete_topics([f"{topic}.dlq"])


@pytest.mark.timeout(150)
async def test_rabbit_postgres_backends_terminated_during_a_run_lose_and_double_nothing(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,  # RabbitMQ down fails the test here
    tmp_path: Path,
) -> None:
    run_id = f"pgchaos{uuid.uuid4().hex[:6]}"
    messages = plan(COUNT, DUPLICATE_RATE, 5, run_id)
    queue = f"pgchaos-{run_id}"
    await send_rabbit(messages, queue)
    transport = rabbit_transport(settings.amqp_url, queue)
    try:
        await strike_a_run(transport, pg_dsn, pg_pool, store, run_id, messages, tmp_path)
    finally:
        with contextlib.suppress(Exception):
            async with amqp_channel(settings.amqp_url) as channel:
                for name in (queue, f"{queue}.dlq"):
                    await channel.queue_delete(name)


# --- the outbox under the same chaos: the consumer emits a payment.booked event per payment ---

#: a killed consumer's unsent events go out through the next one's relay within seconds
EMIT_RELAY = ["--relay-every", "1", "--relay-after", "2"]

#: (idempotency-key header, payment_id) of each event read
Events = list[tuple[str, str]]


def _event(key: Any, body: bytes) -> tuple[str, str]:
    return _text(key), str(json.loads(body)["payment_id"])


async def kafka_events(settings: Settings, topic: str, partitions: int) -> Events:
    """Every event in ``topic`` now (up to the end offsets read first)."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    reader = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await reader.start()
    events: Events = []
    try:
        ends = await reader.end_offsets(tps)
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        deadline = time.monotonic() + 30
        while [tp for tp in tps if await reader.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, "reading the events took too long"
            for records in (await reader.getmany(timeout_ms=500)).values():
                for r in records:
                    events.append(_event(dict(r.headers or ()).get("idempotency-key"), r.value))
    finally:
        await reader.stop()
    return events


async def rabbit_events(settings: Settings, queue: str) -> Events:
    """Every event in ``queue`` now, left in it (taken unacked, back when the channel closes)."""
    events: Events = []
    async with amqp_channel(settings.amqp_url) as channel:
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelClosed:  # nothing emitted yet: no queue yet
            return events
        while (message := await declared.get(no_ack=False, fail=False)) is not None:
            events.append(_event((message.headers or {}).get("idempotency-key"), message.body))
    return events


async def booked_ids(pool: asyncpg.Pool, run_id: str) -> set[str]:
    rows = await pool.fetch(
        "SELECT DISTINCT payment_id FROM demo_ledger WHERE payment_id LIKE $1", f"{run_id}-pay-%"
    )
    return {r["payment_id"] for r in rows}


async def emit_under_strikes(
    transport: Transport,
    read_events: Callable[[], Awaitable[Events]],
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    run_id: str,
    messages: list[Any],
    logs: Path,
) -> None:
    """SIGKILL cycles under strikes, then a survivor under strikes that finishes the stream:
    no event may exist for a payment not booked (checked after the kills, mid-run), and at the
    end every booked payment's event exists at least once, exactly once after deduplication by
    its idempotency-key header, which is the one derived from the payment's key."""
    rng = random.Random(run_id)
    distinct = len({m.key for m in messages})
    terminator = await Terminator.open(pg_dsn)
    consumers: list[Consumer] = []

    async def start(n: int) -> Consumer:
        c = await Consumer.start(
            pg_dsn, transport.name, transport.topic, transport.extra, logs / f"emit-{n}.log"
        )
        consumers.append(c)
        return c

    async def unsent() -> int:  # committed events not yet confirmed by the broker
        return int(
            await pg_pool.fetchval(
                f"SELECT count(*) FROM {store.outbox.table} WHERE status = 'pending'"
                " AND scope = $1 AND unit_key LIKE $2",
                LEDGER_SCOPE,
                f"{run_id}:%",
            )
        )

    try:
        for cycle in range(KILL_CYCLES):
            proc = await start(cycle)
            for _ in range(rng.randint(1, 2)):
                await asyncio.sleep(rng.uniform(0.2, 0.5))
                await terminator.strike()
            await asyncio.sleep(rng.uniform(0.1, 0.4))
            await proc.kill()
        booked = await resilient(lambda: booked_ids(pg_pool, run_id))
        assert 0 < len(booked) < distinct, f"the kills must land mid-run ({len(booked)} booked)"
        early = {payment for _, payment in await read_events()}
        assert early <= booked, f"events for payments never booked: {sorted(early - booked)[:5]}"

        survivor = await start(KILL_CYCLES)
        for _ in range(FINAL_STRIKES):
            await asyncio.sleep(rng.uniform(0.4, 0.8))
            await terminator.strike()
            survivor.assert_alive("after a strike")
        deadline = time.monotonic() + 90
        while True:  # every payment booked, and every event it emitted confirmed
            done = len(await resilient(lambda: booked_ids(pg_pool, run_id)))
            if done >= distinct and not await resilient(unsent):
                break
            survivor.assert_alive("before the stream and its events were done")
            assert time.monotonic() < deadline, (
                f"{done} of {distinct} booked, {await resilient(unsent)} events unsent;"
                f" survivor stderr:\n{survivor.tail()}"
            )
            await asyncio.sleep(0.3)
        await survivor.stop()
    finally:
        for c in consumers:
            if c.alive:
                await c.kill()
        await terminator.close()
    await resilient(lambda: pg_pool.fetchval("SELECT 1"))
    await assert_exactly_once(pg_pool, run_id, messages)

    events = await read_events()
    keys = await resilient(lambda: sent_keys(store, LEDGER_SCOPE))
    key_of = {f"{run_id}-pay-{m.key.rsplit(':', 1)[1]}": keys[m.key] for m in messages}
    first: dict[str, str] = {}  # idempotency-key -> payment, deduplicated
    for key, payment in events:
        assert key == key_of.get(payment), f"event for {payment} with key {key!r}"
        first.setdefault(key, payment)
    per_payment = Counter(first.values())
    booked = await booked_ids(pg_pool, run_id)
    assert set(per_payment) == booked and set(per_payment.values()) == {1}
    assert len(events) >= len(booked) == distinct  # at least once; copies are the header's job
    print(
        f"\n[{transport.name}] {len(events)} events for {len(booked)} booked payments"
        f" ({len(events) - len(booked)} copies, dropped by their key);"
        f" {len(terminator.strikes)} strikes, {KILL_CYCLES} SIGKILLs"
    )


@pytest.mark.timeout(240)
async def test_kafka_emitted_events_once_each_after_dedup_through_kills_and_strikes(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    kafka_admin: Any,
    kafka_topic_factory: Any,
    tmp_path: Path,
) -> None:
    run_id = f"pgemit{uuid.uuid4().hex[:6]}"
    messages = plan(COUNT, DUPLICATE_RATE, 6, run_id)
    topic = await kafka_topic_factory("pgemit", partitions=PARTITIONS)
    booked = await kafka_topic_factory("pgemit-booked", partitions=2)
    await send_kafka(messages, topic)
    transport = await kafka_transport(settings, kafka_admin, topic, run_id)
    transport.extra += ["--emit", booked, *EMIT_RELAY]
    try:
        await emit_under_strikes(
            transport,
            lambda: kafka_events(settings, booked, 2),
            pg_dsn,
            pg_pool,
            store,
            run_id,
            messages,
            tmp_path,
        )
    finally:
        with contextlib.suppress(Exception):
            if f"{topic}.dlq" in await kafka_admin.list_topics():
                await kafka_admin.delete_topics([f"{topic}.dlq"])


@pytest.mark.timeout(240)
async def test_rabbit_emitted_events_once_each_after_dedup_through_kills_and_strikes(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,  # RabbitMQ down fails the test here
    tmp_path: Path,
) -> None:
    run_id = f"pgemit{uuid.uuid4().hex[:6]}"
    messages = plan(COUNT, DUPLICATE_RATE, 6, run_id)
    queue = f"pgemit-{run_id}"
    booked = f"{queue}.booked"
    await send_rabbit(messages, queue)
    transport = rabbit_transport(settings.amqp_url, queue)
    transport.extra += ["--emit", booked, *EMIT_RELAY]
    try:
        await emit_under_strikes(
            transport,
            lambda: rabbit_events(settings, booked),
            pg_dsn,
            pg_pool,
            store,
            run_id,
            messages,
            tmp_path,
        )
    finally:
        with contextlib.suppress(Exception):
            async with amqp_channel(settings.amqp_url) as channel:
                for name in (queue, f"{queue}.dlq", booked):
                    await channel.queue_delete(name)
