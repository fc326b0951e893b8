"""Postgres as users deploy it, under the payments demo consumer on Kafka and on RabbitMQ:

- a database that turns read-only for a few seconds (what a demoted primary, a node behind a
  stale DNS name or a maintenance window answers: SQLSTATE 25006);
- PgBouncer in transaction pooling mode between the consumer and Postgres, the consumer
  SIGKILLed and restarted mid-run; and the HTTP example behind the same PgBouncer, a duplicate
  request arriving while the first one runs;
- a real fail-over on the pair of ``scripts/services``: the consumer's DSN names both nodes
  (``target_session_attrs=read-write``); mid-run the primary is stopped (or left up, read-only)
  and the standby promoted.

Every payment is good data, so each run must end with every payment booked exactly once (ledger
rows, no doubles, exact balances, every idempotency record ``completed``), nothing dead-lettered,
nothing left unsettled on the broker, and the consumer working again by itself: the seconds from
the end of the fault to the next booking are printed (``resumed in``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import httpx
import pytest

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings
from examples.payments_producer import PARTITIONS, plan, send_kafka, send_rabbit
from handlers.payments import ensure_tables
from tests._failover import FailoverPair
from tests._payments import ledger_count
from tests.conftest import free_port, with_database
from tests.test_chaos_postgres import (
    TERMINATE_ALL,
    Consumer,
    Transport,
    amqp_channel,
    assert_every_message_settled_once,
    kafka_transport,
    rabbit_transport,
    resilient,
)
from tests.test_payments_api import SECRET, charges, serve

COUNT = 1200
DUPLICATE_RATE = 0.1
#: how long the database stays read-only
READ_ONLY_SECONDS = 5.0
#: the consumer must be booking again this soon after a fault ends
RESUME_WITHIN = 20.0
#: and must have finished the stream this soon after
FINISH_WITHIN = 60.0


@dataclass
class Run:
    """One payments run: the messages on the broker, the consumer processes, the test's own
    pool on the same database (for reading the ledger) and a timeline for the report."""

    settings: Settings
    transport: Transport
    consumer_dsn: str
    store_dsn: str
    pool: asyncpg.Pool
    store: PostgresStore
    run_id: str
    messages: list[Any]
    logs: Path
    consumers: list[Consumer] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def distinct(self) -> int:
        return len({m.key for m in self.messages})

    def mark(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.started:5.1f}s {what}")

    async def booked(self) -> int:
        return await resilient(lambda: ledger_count(self.pool, self.run_id))

    async def start(self) -> Consumer:
        consumer = await Consumer.start(
            self.consumer_dsn,
            self.transport.name,
            self.transport.topic,
            self.transport.extra,
            self.logs / f"consumer-{len(self.consumers)}.log",
        )
        self.consumers.append(consumer)
        self.mark(f"consumer {len(self.consumers)} started")
        if self.transport.name == "rabbit":  # it declares its dead-letter queue once running
            await self.dead_letter_queue_declared(consumer)
        return consumer

    async def dead_letter_queue_declared(self, consumer: Consumer) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                async with amqp_channel(self.settings.amqp_url) as channel:
                    await channel.declare_queue(f"{self.transport.topic}.dlq", passive=True)
                return
            except aio_pika.exceptions.ChannelClosed:
                consumer.assert_alive("before it declared its queues")
                assert time.monotonic() < deadline, "the consumer never declared its queues"
                await asyncio.sleep(0.2)

    async def wait_booked(self, share: float, consumer: Consumer, within: float = 30) -> int:
        """Until ``share`` of the payments are booked (the fault must land mid-run)."""
        deadline = time.monotonic() + within
        while (done := await self.booked()) < share * self.distinct:
            consumer.assert_alive("before the fault")
            await self.transport.assert_nothing_dead_lettered()
            assert time.monotonic() < deadline, f"only {done} booked before the fault"
            await asyncio.sleep(0.1)
        assert done < self.distinct, "the run ended before the fault"
        return done

    async def resumed(self, consumer: Consumer, after: int, since: float, what: str) -> float:
        """Seconds from ``since`` (the fault's end) to the first booking past ``after``."""
        while (done := await self.booked()) <= after:
            consumer.assert_alive(f"while it should resume after {what}")
            if time.monotonic() - since > RESUME_WITHIN:
                await self.transport.assert_nothing_dead_lettered()
                raise AssertionError(
                    f"no payment booked {RESUME_WITHIN}s after {what} ({done} booked);"
                    f" consumer stderr:\n{consumer.tail()}"
                )
            await asyncio.sleep(0.05)
        seconds = time.monotonic() - since
        self.mark(f"resumed {seconds:.2f}s after {what} ({done} booked)")
        return seconds

    async def finish(self, consumer: Consumer) -> dict[str, Any]:
        """Until every payment is booked (and, on Kafka, every offset committed), then a
        graceful stop, and a drainer for whatever the stop handed back to the broker."""
        deadline = time.monotonic() + FINISH_WITHIN
        next_look = 0.0
        while (done := await self.booked()) < self.distinct:
            consumer.assert_alive("before the stream was done")
            if time.monotonic() > next_look:  # a dead-lettered payment fails now, not later
                await self.transport.assert_nothing_dead_lettered()
                next_look = time.monotonic() + 1.0
            assert time.monotonic() < deadline, (
                f"only {done} of {self.distinct} booked; consumer stderr:\n{consumer.tail()}"
            )
            await asyncio.sleep(0.2)
        self.mark("every payment booked")
        if self.transport.name == "kafka":
            while await self.transport.unsettled() and time.monotonic() < deadline:
                consumer.assert_alive("before its offsets were committed")
                await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # anything still arriving would be a double
        stats = await consumer.stop()
        self.mark(f"stopped: {stats}")
        if await self.transport.unsettled():
            drainer = await self.start()
            while await self.transport.unsettled() and time.monotonic() < deadline + 30:
                drainer.assert_alive("while draining")
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)  # an ack in flight
            await drainer.stop()
            self.mark("drained")
        return stats

    async def verify(self, stats: dict[str, Any]) -> None:
        print(f"\n[{self.transport.name}] " + "\n".join(self.timeline))
        assert stats["dead_lettered"] == 0, stats
        await resilient(lambda: self.pool.fetchval("SELECT 1"))
        await assert_every_message_settled_once(
            self.transport, self.pool, self.store, self.run_id, self.messages
        )

    async def reconnect(self) -> None:
        """A new pool for the test's reads, connecting anew through its DSN."""
        old = self.pool
        pool = await asyncpg.create_pool(self.store_dsn, min_size=1, max_size=4)
        assert pool is not None
        self.pool, self.store = pool, PostgresStore(pool)
        old.terminate()

    async def kill_all(self) -> None:
        for consumer in self.consumers:
            if consumer.alive:
                await consumer.kill()


@contextlib.asynccontextmanager
async def payments_run(
    transport_name: str,
    prefix: str,
    store_dsn: str,
    consumer_dsn: str,
    settings: Settings,
    kafka_admin: Any,
    kafka_topic_factory: Any,
    logs: Path,
) -> AsyncIterator[Run]:
    """The run's database made ready as a deployment would (the store migrated, the demo
    tables created, straight on ``store_dsn``), its payments on the broker, and everything
    removed afterwards (consumers killed, queues and dead-letter topics deleted)."""
    run_id = f"{prefix}{uuid.uuid4().hex[:6]}"
    messages = plan(COUNT, DUPLICATE_RATE, 7, run_id)
    pool = await asyncpg.create_pool(store_dsn, min_size=1, max_size=4)
    assert pool is not None
    store = PostgresStore(pool)
    await store.migrate()
    await ensure_tables(pool)
    if transport_name == "kafka":
        topic = await kafka_topic_factory(prefix, partitions=PARTITIONS)
        await send_kafka(messages, topic)
        transport = await kafka_transport(settings, kafka_admin, topic, run_id)
    else:
        topic = f"{prefix}-{run_id}"
        await send_rabbit(messages, topic)
        transport = rabbit_transport(settings.amqp_url, topic)
    run = Run(settings, transport, consumer_dsn, store_dsn, pool, store, run_id, messages, logs)
    try:
        yield run
    finally:
        await run.kill_all()
        run.pool.terminate()
        with contextlib.suppress(Exception):
            if transport_name == "kafka":
                if f"{topic}.dlq" in await kafka_admin.list_topics():
                    await kafka_admin.delete_topics([f"{topic}.dlq"])
            else:
                async with amqp_channel(settings.amqp_url) as channel:
                    for name in (topic, f"{topic}.dlq"):
                        await channel.queue_delete(name)


@pytest.fixture
def payments(
    settings: Settings,
    kafka_admin: Any,
    kafka_topic_factory: Any,
    amqp_connection: Any,  # RabbitMQ down fails the test here
    tmp_path: Path,
) -> Callable[..., contextlib.AbstractAsyncContextManager[Run]]:
    """``payments(transport, prefix, store_dsn, consumer_dsn=store_dsn)``: a
    :func:`payments_run` on this test's brokers, its logs in the test's own folder."""

    def run(
        transport: str, prefix: str, store_dsn: str, consumer_dsn: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[Run]:
        return payments_run(
            transport,
            prefix,
            store_dsn,
            consumer_dsn or store_dsn,
            settings,
            kafka_admin,
            kafka_topic_factory,
            tmp_path,
        )

    return run


def database_of(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


# --- 1. the database turns read-only for a few seconds ------------------------------------------


async def read_only_for(admin_dsn: str, database: str, seconds: float) -> tuple[float, float]:
    """``default_transaction_read_only`` on this database only (never the shared server's
    configuration), for ``seconds``. Its sessions are terminated at both edges so that every
    connection sees the change, as a server-wide reload would make them. Returns the monotonic
    times the fault began and ended."""
    admin = await asyncpg.connect(admin_dsn, timeout=5)
    try:
        await admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        await admin.fetch(TERMINATE_ALL, database)
        began = time.monotonic()
        await asyncio.sleep(seconds)
        await admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        await admin.fetch(TERMINATE_ALL, database)
        return began, time.monotonic()
    finally:
        await admin.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
async def test_a_database_read_only_for_seconds_dead_letters_nothing_and_is_waited_out(
    transport: str,
    settings: Settings,
    own_database: str,
    payments: Callable[..., contextlib.AbstractAsyncContextManager[Run]],
) -> None:
    async with payments(transport, "pgro", own_database) as run:
        consumer = await run.start()
        await run.wait_booked(0.15, consumer)
        began, ended = await read_only_for(
            settings.pg_dsn, database_of(own_database), READ_ONLY_SECONDS
        )
        at_end = await run.booked()
        run.mark(f"read-only for {ended - began:.1f}s: {at_end} booked")
        await run.transport.assert_nothing_dead_lettered()
        consumer.assert_alive("after the read-only spell")
        resume = await run.resumed(consumer, at_end, ended, "the database became writable")
        stats = await run.finish(consumer)
        await run.verify(stats)
        print(f"[{transport}] read-only {READ_ONLY_SECONDS}s: resumed in {resume:.2f}s")


# --- 2. PgBouncer in transaction pooling mode --------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
async def test_behind_pgbouncer_in_transaction_mode_a_sigkilled_consumer_restarts_and_loses_nothing(
    transport: str,
    own_database: str,
    pgbouncer_dsn: str,
    payments: Callable[..., contextlib.AbstractAsyncContextManager[Run]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    through_pooler = with_database(pgbouncer_dsn, database_of(own_database))
    # what a user sets behind a transaction pooler (the consumer processes inherit it)
    monkeypatch.setenv("CONSUMER_IDEM_PG_POOLER", "transaction")
    async with payments(transport, "pgbnc", own_database, through_pooler) as run:
        consumer = await run.start()
        resumes = []
        for share in (0.15, 0.45):
            await run.wait_booked(share, consumer)
            await consumer.kill()
            at_kill = await run.booked()
            run.mark(f"SIGKILL: {at_kill} booked")
            await run.transport.assert_nothing_dead_lettered()
            restarted_at = time.monotonic()
            consumer = await run.start()
            resumes.append(await run.resumed(consumer, at_kill, restarted_at, "the restart"))
        stats = await run.finish(consumer)
        await run.verify(stats)
        print(
            f"[{transport}] behind PgBouncer (transaction mode), 2 SIGKILLs: resumed in "
            + ", ".join(f"{s:.2f}s" for s in resumes)
            + " from each restart"
        )


@pytest.mark.timeout(120)
async def test_the_payments_api_behind_pgbouncer_charges_once_and_a_duplicate_waits_for_the_first(
    own_database: str, pgbouncer_dsn: str
) -> None:
    """The HTTP example with its store through PgBouncer (transaction mode): concurrent
    duplicates charge once, and a duplicate that arrives while the first request is still
    charging waits for it and replays its response (``wait``: no 409, no second charge)."""
    through_pooler = with_database(pgbouncer_dsn, database_of(own_database))
    pool = await asyncpg.create_pool(own_database, min_size=1, max_size=2)
    assert pool is not None
    await PostgresStore(pool).migrate()  # the deployment's migration step, straight to 5432
    api_port, gateway_port = free_port(), free_port()
    api, gateway = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gateway_port}"
    # no webhooks: on two loaded cores their retries slow the stand-in gateway past the API's
    # 2 s timeout, and a charge whose outcome is unknown is not this test's subject
    servers = [await serve("examples.fake_gateway:app", gateway_port, {})]
    try:
        servers.append(
            await serve(
                "examples.payments_api:app",
                api_port,
                {
                    "CONSUMER_IDEM_PG_DSN": through_pooler,
                    "CONSUMER_IDEM_PG_POOLER": "transaction",
                    "GATEWAY_URL": gateway,
                    "GATEWAY_WEBHOOK_SECRET": SECRET,
                },
            )
        )
        keys = [f"k-{uuid.uuid4().hex}" for _ in range(30)]
        body = {"customer_id": "c-1", "amount_cents": 1000, "currency": "EUR"}
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=api, limits=limits, timeout=30) as client:

            async def post(key: str) -> httpx.Response:
                return await client.post("/payments", json=body, headers={"Idempotency-Key": key})

            # 1. every key three times at once, five keys at a time: each charged once, every
            # copy answered with its 201
            responses = []
            for i in range(0, len(keys), 5):
                responses += await asyncio.gather(
                    *(post(key) for key in keys[i : i + 5] for _ in range(3))
                )
            statuses = Counter(r.status_code for r in responses)
            odd = [(r.status_code, r.text[:160]) for r in responses if r.status_code != 201]
            assert statuses == {201: 3 * len(keys)}, (statuses, odd[:4])
            for i, key in enumerate(keys):
                assert len({r.content for r in responses[3 * i : 3 * i + 3]}) == 1, key
            assert await charges(gateway) == len(keys)

            # 2. a duplicate arriving while the first one is still charging waits for it
            await client.post(f"{gateway}/_faults", json={"slow_charge_ms": 1500})
            key = f"k-{uuid.uuid4().hex}"
            first = asyncio.create_task(post(key))
            first_answered: list[float] = []
            first.add_done_callback(lambda _: first_answered.append(time.monotonic()))
            await asyncio.sleep(0.4)
            assert not first.done()
            duplicate = await post(key)
            duplicate_answered = time.monotonic()
            answer = await first
            assert answer.status_code == 201, answer.text
            assert duplicate.status_code == 201, duplicate.text
            assert duplicate.headers.get("idempotent-replayed") == "true"
            assert duplicate.content == answer.content
            assert await charges(gateway) == len(keys) + 1
        rows = await pool.fetchval("SELECT count(*) FROM api_payments")
        assert rows == len(keys) + 1
        lag = duplicate_answered - first_answered[0]
        print(
            f"\n[http] behind PgBouncer: the waiting duplicate answered {lag:+.3f}s after the first"
        )
    finally:
        for proc in servers:
            proc.kill()
            await proc.wait()
        await pool.close()


# --- 3. a real fail-over ----------------------------------------------------------------------


async def fail_over(
    run: Run,
    pair: FailoverPair,
    consumer: Consumer,
    fence: Callable[[], Awaitable[None]],
    what: str,
) -> float:
    """Mid-run: fence the primary (``fence``), promote the standby; returns the seconds from
    the promotion's end to the next booking (and prints those from the fence)."""
    before = await run.wait_booked(0.2, consumer)
    fenced_at = time.monotonic()
    await fence()
    run.mark(f"primary {what} (at least {before} booked)")  # no writable node to read now
    # A fail-over is never instant after the fence: transactions that began before it finish
    # (their commits reach the synchronous standby) before the standby is promoted.
    await asyncio.sleep(1.0)
    promotion = await pair.promote_standby()
    promoted_at = time.monotonic()
    # the test's own pool reads the new primary from here on (the old one, when left up, no
    # longer sees the bookings)
    await run.reconnect()
    at_promotion = await run.booked()
    run.mark(f"standby promoted in {promotion:.2f}s: {at_promotion} booked")
    await run.transport.assert_nothing_dead_lettered()
    resume = await run.resumed(consumer, at_promotion, promoted_at, "the promotion")
    run.mark(f"{time.monotonic() - fenced_at:.2f}s from the fence to the next booking")
    return resume


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
async def test_a_fail_over_to_the_promoted_standby_loses_and_doubles_nothing(
    transport: str,
    failover_pair: FailoverPair,
    payments: Callable[..., contextlib.AbstractAsyncContextManager[Run]],
) -> None:
    """The primary stops at once (a crash), the standby is promoted."""
    async with payments(transport, "pgfo", failover_pair.dsn) as run:
        consumer = await run.start()
        resume = await fail_over(
            run, failover_pair, consumer, failover_pair.stop_primary, "stopped"
        )
        stats = await run.finish(consumer)
        await run.verify(stats)
        print(f"[{transport}] fail-over, old primary stopped: resumed in {resume:.2f}s")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
async def test_a_fail_over_with_the_old_primary_left_up_read_only_loses_and_doubles_nothing(
    transport: str,
    failover_pair: FailoverPair,
    payments: Callable[..., contextlib.AbstractAsyncContextManager[Run]],
) -> None:
    """The primary is demoted (read-only, every session) but keeps answering, the standby is
    promoted: the consumer's connections to the old primary must give way to the new one."""
    async with payments(transport, "pgfr", failover_pair.dsn) as run:
        consumer = await run.start()
        resume = await fail_over(
            run, failover_pair, consumer, failover_pair.demote_primary, "demoted, still up"
        )
        stats = await run.finish(consumer)
        await run.verify(stats)
        print(f"[{transport}] fail-over, old primary up read-only: resumed in {resume:.2f}s")
