"""RabbitMQ batch mode (``RabbitRunner`` with an ``@idempotent_consumer(batch=True)`` handler),
against the real broker and database: many deliveries per transaction, acks after the commit as
multiple acks that never cover a delivery still in hand, the fallback to one transaction per
message when a member fails, the delivery budget, Postgres connections terminated mid-run and
consumer processes SIGKILLed mid-batch."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aio_pika
import asyncpg
import pytest

from consumer_idem import (
    ConsumerMessage,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.consumer import Action
from consumer_idem.transports.rabbit import AckWindow, RabbitRunner
from examples.payments_producer import plan, send_rabbit
from handlers.payments import LEDGER_SCOPE, record_payments
from tests._payments import assert_exactly_once, ledger_count, payment, wait_until
from tests.conftest import QUORUM, ROOT_DIR, delete_queues


@pytest.fixture
def run_id() -> str:
    return f"rb{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def queues(settings: Settings, queue_name: str) -> AsyncIterator[str]:
    yield queue_name
    await delete_queues(settings, queue_name, f"{queue_name}.dlq")


class Booked:
    """A batch handler that books payments and remembers the size of every call."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.counts: list[list[int | None]] = []  # x-delivery-count of each member, per call

    async def __call__(self, messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        self.sizes.append(len(messages))
        self.counts.append([m.delivery_count for m in messages])
        await record_payments(messages, conn)


async def run_until(runner: RabbitRunner, settled: int, within: float = 60) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def done() -> bool:
            if task.done():
                task.result()  # a runner that died says why
            return runner.stats.processed >= settled

        await wait_until(done, within, f"{settled} deliveries to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def ready_count(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def drain(channel: aio_pika.abc.AbstractChannel, queue: str) -> list[Any]:
    q = await channel.get_queue(queue)
    out = []
    while (message := await q.get(fail=False, no_ack=True)) is not None:
        out.append(message)
    return out


async def test_batches_commit_many_deliveries_at_once_and_absorb_duplicates(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    messages = plan(600, 0.3, 4, run_id)
    await send_rabbit(messages, queues)
    booked = Booked()
    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=True)(
        booked
    )
    runner = RabbitRunner(consumer, queue=queues, batch_size=50, batch_wait=0.05)
    assert runner.prefetch == 200  # four batches in the window by default
    await run_until(runner, len(messages))

    assert runner.stats.processed == len(messages) == 780
    assert runner.stats.duplicates == 180 and runner.stats.executed == 600
    # every key ran once, in batches (a re-send in the same batch as its original never
    # reaches the handler): no member failed, so no fallback either
    assert sum(booked.sizes) == 600 and max(booked.sizes) <= 50
    assert len(booked.sizes) <= 600 // 10
    await assert_exactly_once(pg_pool, run_id, messages)
    # everything was acked: nothing comes back now that the runner's channel is closed
    channel = await amqp_connection.channel()
    await asyncio.sleep(0.5)
    assert await ready_count(channel, queues) == 0


async def test_a_failing_member_falls_back_to_one_by_one_and_a_poison_one_is_dead_lettered(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    bodies = [(f"{run_id}-{n}", payment(run_id, n)) for n in range(30)]
    bodies.insert(12, (f"{run_id}-poison", b'{"payment_id": "no amount"}'))
    for key, body in bodies:
        await channel.default_exchange.publish(
            aio_pika.Message(body, headers={"idempotency-key": key}), routing_key=queues
        )
    flaky = f"{run_id}-20"
    failures = 0
    sizes: list[int] = []

    @idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=True, backoff=(0.05, 0.2)
    )
    async def book(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        nonlocal failures
        sizes.append(len(messages))
        if failures < 2 and any(m.header("idempotency-key") == flaky.encode() for m in messages):
            failures += 1  # in the batch, then alone in the fallback: then it works
            raise RuntimeError("a flaky dependency")
        await record_payments(messages, conn)

    runner = RabbitRunner(book, queue=queues, batch_size=40, batch_wait=0.3)
    await run_until(runner, len(bodies))

    # The whole batch failed once, then its members ran alone, up to the flaky one (22 of them,
    # the poison one among them); the flaky one failed again and left the batch, to be
    # delivered again later and run alone; the nine after it went on as a batch of their own.
    assert sizes[0] == 31 and sorted(sizes[1:]) == [1] * 23 + [9]
    assert runner.stats.retries >= 1
    dead = await drain(channel, f"{queues}.dlq")
    assert [(m.headers["x-dead-letter-reason"], m.headers["idempotency-key"]) for m in dead] == [
        ("invalid_payment", f"{run_id}-poison")
    ]
    assert await ledger_count(pg_pool, run_id) == 30
    flaky_record = await store.get(scope, flaky)
    assert flaky_record is not None and flaky_record.status == "completed"
    await asyncio.sleep(0.5)
    assert await ready_count(channel, queues) == 0


async def take_and_die(settings: Settings, queue: str, n: int) -> None:
    """A consumer that takes ``n`` deliveries and dies without settling them: the quorum queue
    counts one more delivery for each."""
    doomed = await aio_pika.connect(settings.amqp_url)
    q = await (await doomed.channel()).get_queue(queue)
    for _ in range(n):
        assert await q.get(timeout=5) is not None
    await doomed.close()


async def test_postgres_connections_terminated_mid_run_lose_and_double_nothing(
    pg_dsn: str,
    demo_tables: None,
    pg_pool: asyncpg.Pool,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    messages = plan(3000, 0.2, 5, run_id)
    await send_rabbit(messages, queues)
    app = f"batch-kill-{run_id}"
    pool = await asyncpg.create_pool(
        pg_dsn, min_size=2, max_size=8, server_settings={"application_name": app}
    )
    assert pool is not None
    store = PostgresStore(pool)

    async def slow_book(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await record_payments(messages, conn)
        await asyncio.sleep(0.02)  # a window in which the terminations land mid-transaction

    consumer = idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), batch=True, backoff=(0.05, 0.5)
    )(slow_book)
    runner = RabbitRunner(consumer, queue=queues, batch_size=50)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    terminated = 0
    try:
        for _ in range(8):
            await asyncio.sleep(0.25)
            terminated += await pg_pool.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = $1) t",
                app,
            )

        async def all_settled() -> bool:
            return runner.stats.processed >= len(messages)

        await wait_until(all_settled, 120, "every delivery to be settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await pool.close()
    assert terminated >= 4
    assert runner.stats.processed == len(messages)
    await assert_exactly_once(pg_pool, run_id, messages)
    channel = await amqp_connection.channel()
    await asyncio.sleep(0.5)
    assert await ready_count(channel, queues) == 0


async def start_worker(pg_dsn: str, queue: str, batch: int, slow_ms: int) -> Any:
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._rabbit_batch",
        queue,
        str(batch),
        str(slow_ms),
        cwd=ROOT_DIR,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    assert json.loads(line)["event"] == "started", line
    return proc


async def test_sigkill_mid_batch_loses_and_doubles_nothing(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
) -> None:
    messages = plan(1500, 0.1, 6, run_id)
    await send_rabbit(messages, queues)
    rng = random.Random(run_id)
    kills = 0
    # batches of 20, each 300 ms in its transaction, four in the window: ~250 msg/s, so every
    # kill lands with batches uncommitted and others committed but maybe not acked
    while kills < 6:
        proc = await start_worker(pg_dsn, queues, 20, 300)
        await asyncio.sleep(rng.uniform(0.3, 0.9))
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        kills += 1
    booked = await ledger_count(pg_pool, run_id)
    assert 0 < booked < 1500, f"the kills must land mid-run (booked {booked})"
    final = await start_worker(pg_dsn, queues, 20, 10)

    async def all_booked() -> bool:
        return await ledger_count(pg_pool, run_id) >= 1500

    await wait_until(all_booked, 120, "the last consumer to finish")
    await asyncio.sleep(1.0)  # anything still arriving would be a double
    final.send_signal(signal.SIGTERM)
    out, _ = await asyncio.wait_for(final.communicate(), timeout=60)
    assert final.returncode == 0
    stats = json.loads(out.decode().strip().splitlines()[-1])
    assert stats["dead_lettered"] == 0
    await assert_exactly_once(pg_pool, run_id, messages)
    stuck = await pg_pool.fetchval(
        f"SELECT count(*) FROM {store.table} WHERE scope = $1 AND key LIKE $2"
        " AND status <> 'completed'",
        LEDGER_SCOPE,
        f"{run_id}:%",
    )
    assert stuck == 0
    channel = await amqp_connection.channel()
    await asyncio.sleep(0.5)
    assert await ready_count(channel, queues) == 0


async def test_concurrent_batches_sharing_keys_in_any_order_never_deadlock(
    store: PostgresStore, scope: str
) -> None:
    """Two batches of the same 2,000 keys, in opposite orders, at once: the second waits for
    the first's commit and replays, instead of a deadlock aborting one of them."""
    entered = asyncio.Event()

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=True)
    async def slow(messages: Sequence[ConsumerMessage], conn: asyncpg.Connection) -> None:
        entered.set()
        await asyncio.sleep(0.3)  # hold the claims while the other batch claims

    def batch(order: range) -> list[ConsumerMessage]:
        return [
            ConsumerMessage(b"{}", headers={"idempotency-key": f"k{n:05d}".encode()}) for n in order
        ]

    first, second = await asyncio.gather(
        slow.process_batch(batch(range(2000))),
        slow.process_batch(batch(range(1999, -1, -1))),
    )
    for verdicts in (first, second):
        assert len(verdicts) == 2000
        assert {v.action for v in verdicts} == {Action.ACK}
    # one ran them, the other met them committed
    assert sorted([sum(v.duplicate for v in first), sum(v.duplicate for v in second)]) == [0, 2000]


async def test_a_multiple_ack_never_covers_a_delivery_still_in_hand(
    settings: Settings, amqp_connection: aio_pika.abc.AbstractConnection, queues: str
) -> None:
    publisher = await amqp_connection.channel(publisher_confirms=True)
    await publisher.declare_queue(queues, durable=True, arguments=QUORUM)
    for n in range(10):
        await publisher.default_exchange.publish(aio_pika.Message(str(n).encode()), queues)

    async def take(n: int, linger: float, ready: list[int], held: list[int]) -> int:
        """Take ``n`` deliveries (every one in the queue), pass the ``ready`` ones to an ack
        window (the ``held`` ones stay in hand), flush it, close the channel: how many are in
        the queue then."""
        connection = await aio_pika.connect(settings.amqp_url)
        channel = await connection.channel()
        q = await channel.get_queue(queues)
        got = [await q.get(timeout=5) for _ in range(n)]
        by_body = {int(m.body): m for m in got}
        window = AckWindow(got[0].channel, linger)  # a new channel: its tags start at 1
        for body in ready:
            window.ready(by_body[body])
        due = await window.flush()
        await connection.close()
        await asyncio.sleep(0.5)
        assert (due is None) == (linger == 0 or not held)
        return await ready_count(publisher, queues)

    # 0-2 and 4-5 are ready, 3 is still in hand: one multiple ack for 0-2; 4-5 wait for 3
    assert await take(10, 10.0, [0, 1, 2, 4, 5], [3]) == 7
    # a gap that lingers (linger 0: due at once): 4 and 5 are acked on their own, 3 stays
    assert await take(7, 0.0, [4, 5], [3]) == 5
