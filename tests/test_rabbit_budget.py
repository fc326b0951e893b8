"""RabbitMQ delivery budgets (``max_deliveries``) counted by the attempts that ran a key's
handler, and the consumed queue's own ``x-delivery-limit``, against the real broker and
database: a poison message that kills its consumer process, deliveries returned by consumers
that died before running them, a completed key whose acks were lost, and queues declared with
delivery limits the budget cannot live with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator

import aio_pika
import asyncpg
import pytest

from consumer_idem import (
    ConfigurationError,
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.stores.postgres.attempts import DeliveryAttempts
from consumer_idem.transports.rabbit import RabbitRunner
from consumer_idem.transports.rabbit_limits import DELIVERY_LIMIT, declared_arguments
from handlers.payments import LEDGER_SCOPE
from tests._payments import ledger_count, payment, wait_until
from tests.conftest import QUORUM, ROOT_DIR, delete_queues
from tests.test_rabbit_batch import Booked, drain, ready_count, run_until, take_and_die


@pytest.fixture
def run_id() -> str:
    return f"rd{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def queues(settings: Settings, queue_name: str) -> AsyncIterator[str]:
    yield queue_name
    await delete_queues(settings, queue_name, f"{queue_name}.dlq")


async def attempts(store: PostgresStore, scope: str, key: str) -> int | None:
    value = await store.pool.fetchval(
        f'SELECT attempts FROM "{store.schema}".delivery_attempts WHERE scope = $1 AND key = $2',
        scope,
        key,
    )
    return None if value is None else int(value)


async def start_poisoned(
    pg_dsn: str, queue: str, max_deliveries: int
) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._rabbit_poison",
        queue,
        str(max_deliveries),
        cwd=ROOT_DIR,
        env=dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    if line == b"":  # a poison killed it before it could say it started
        await asyncio.wait_for(proc.wait(), timeout=60)
        return proc
    assert json.loads(line)["event"] == "started", line
    return proc


async def test_a_poison_that_kills_its_consumer_spends_only_its_own_budget(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
) -> None:
    """19 good messages and one that kills the consumer process whenever it runs, in one
    prefetch window: every crash returns all unacked deliveries and the broker counts them
    all, but only the poison's own runs count. The 19 are booked once each, the poison alone
    is dead-lettered, after max_deliveries runs of its own."""
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    keys = [f"{run_id}-{n}" for n in range(20)]
    for n, key in enumerate(keys):
        headers: dict[str, str] = {"idempotency-key": key}
        if n == 3:
            headers["poison"] = "yes"
        await channel.default_exchange.publish(
            aio_pika.Message(payment(run_id, n), headers=headers), routing_key=queues
        )
    crashes = 0
    proc = await start_poisoned(pg_dsn, queues, 2)
    try:
        for _ in range(60):  # at most 60 s
            settled = await ledger_count(pg_pool, run_id) >= 19
            if settled and await ready_count(channel, f"{queues}.dlq") >= 1:
                break
            if proc.returncode is not None or (await _exited(proc)):
                crashes += 1
                assert crashes <= 6, "the poison kept killing consumers"
                proc = await start_poisoned(pg_dsn, queues, 2)
        else:
            raise AssertionError("the queue was not settled within 60 s")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), timeout=60)
    dead = await drain(channel, f"{queues}.dlq")
    assert [m.headers["idempotency-key"] for m in dead] == [keys[3]]
    assert dead[0].headers["x-dead-letter-reason"] == "max_deliveries"
    good = [k for k in keys if k != keys[3]]
    booked = await pg_pool.fetchval(
        "SELECT count(DISTINCT payment_id) FROM demo_ledger WHERE payment_id LIKE $1",
        f"{run_id}-%",
    )
    assert booked == 19 == await ledger_count(pg_pool, run_id)  # each once
    assert crashes >= 2  # the first run (in its batch) and its own counted run
    assert await attempts(store, LEDGER_SCOPE, keys[3]) == 2
    for key in good:  # none of them spent more than the one run that settled it
        assert (await attempts(store, LEDGER_SCOPE, key) or 0) <= 2
        record = await store.get(LEDGER_SCOPE, key)
        assert record is not None and record.status == "completed"


async def test_a_redelivered_message_is_not_charged_for_a_fresh_poison_beside_it(
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    store: PostgresStore,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
) -> None:
    """A slow good message, redelivered after a crash, runs and counts an attempt; while it
    runs, a poison delivered for the first time kills the process. The crash is the poison's:
    the good message is booked once and never dead-lettered, however many fresh poisons follow
    (``max_deliveries=2``, three of them)."""
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    good = f"{run_id}-0"

    async def publish(n: int, flag: str) -> None:
        headers = {"idempotency-key": f"{run_id}-{n}", flag: "yes"}
        await channel.default_exchange.publish(
            aio_pika.Message(payment(run_id, n), headers=headers), routing_key=queues
        )

    await publish(0, "slow")
    await publish(1, "poison")  # in the first batch with it: the good one becomes a suspect
    poisons = 2
    for round_ in range(12):
        before = await attempts(store, LEDGER_SCOPE, good) or 0
        proc = await start_poisoned(pg_dsn, queues, 2)
        try:
            for _ in range(100):  # the good one starts its run of 1.5 s (or the process dies)
                if proc.returncode is not None or await ledger_count(pg_pool, run_id):
                    break
                if (await attempts(store, LEDGER_SCOPE, good) or 0) > before:
                    if poisons < 5:
                        await publish(poisons, "poison")  # fresh, while the good one runs
                        poisons += 1
                    break
                await asyncio.sleep(0.05)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=10)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.communicate(), timeout=60)
        dead = [m.headers["idempotency-key"] for m in await drain(channel, f"{queues}.dlq")]
        spent = await attempts(store, LEDGER_SCOPE, good)
        assert good not in dead, f"the good message was dead-lettered (round {round_}, {spent})"
        if await ledger_count(pg_pool, run_id) == 1 and await ready_count(channel, queues) == 0:
            break
    assert await ledger_count(pg_pool, run_id) == 1
    record = await store.get(LEDGER_SCOPE, good)
    assert record is not None and record.status == "completed"
    assert (await attempts(store, LEDGER_SCOPE, good) or 0) <= 2


async def _exited(proc: asyncio.subprocess.Process) -> bool:
    try:
        await asyncio.wait_for(proc.wait(), timeout=1.0)
    except TimeoutError:
        return False
    return True


async def test_deliveries_returned_by_consumers_that_never_ran_them_still_run_alone(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    run_id: str,
    scope: str,
) -> None:
    """Consumers that die holding deliveries (before running them) spend no budget: the
    broker counts those returns, the runner does not. With ``max_deliveries=2`` and two such
    deaths, every message runs, once; the returned ones one at a time, each counted once."""
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    for n in range(12):
        await channel.default_exchange.publish(
            aio_pika.Message(payment(run_id, n), headers={"idempotency-key": f"{run_id}-{n}"}),
            routing_key=queues,
        )
    await take_and_die(settings, queues, 3)
    await take_and_die(settings, queues, 2)
    booked = Booked()
    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=True)(
        booked
    )
    runner = RabbitRunner(consumer, queue=queues, batch_size=20, batch_wait=0.3, max_deliveries=2)
    await run_until(runner, 12)

    assert await drain(channel, f"{queues}.dlq") == []
    assert sorted(booked.sizes) == [1, 1, 1, 9]
    assert await ledger_count(pg_pool, run_id) == 12
    for n in range(12):
        assert await attempts(store, scope, f"{run_id}-{n}") == (1 if n < 3 else None)


async def test_a_completed_key_at_its_budget_is_acked_never_dead_lettered(
    settings: Settings,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    """An effect that committed but whose acks were lost comes back counted by the broker.
    At its budget the runner reads the key's record: completed, so the delivery is acked as a
    replay, not dead-lettered (a dead-letter replay after retention would run it again)."""
    calls = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1

    body, headers = b'{"n": 1}', {"idempotency-key": "paid"}
    first = await handler.process(ConsumerMessage(body, {"idempotency-key": b"paid"}))
    assert first.action == "ack" and calls == 1  # committed; its ack is what was lost
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    await channel.default_exchange.publish(
        aio_pika.Message(body, headers=headers), routing_key=queues
    )
    for _ in range(3):  # returned again and again: the broker counts 3
        await take_and_die(settings, queues, 1)
    # and its own runs before (replays whose acks were lost too) spent its budget
    await DeliveryAttempts(store).count(scope, "paid")

    runner = RabbitRunner(handler, queue=queues, max_deliveries=1)
    await run_until(runner, 1, 30)
    assert calls == 1 and runner.stats.dead_lettered == 0 and runner.stats.duplicates == 1
    assert await drain(channel, f"{queues}.dlq") == []
    assert await ready_count(channel, queues) == 0


async def test_a_handler_that_keeps_failing_is_dead_lettered_after_its_own_runs(
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    """The budget still ends a key whose own handler keeps failing: ``max_deliveries`` runs,
    then a dead letter, reason ``max_deliveries``."""
    from consumer_idem import Retryable

    calls = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.1))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1
        raise Retryable("gateway said try later")

    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    await channel.default_exchange.publish(
        aio_pika.Message(b"{}", headers={"idempotency-key": "failing"}), routing_key=queues
    )
    runner = RabbitRunner(handler, queue=queues, max_deliveries=3)
    await run_until(runner, 1, 30)
    assert calls == 3
    dead_letters = await drain(channel, f"{queues}.dlq")
    assert [m.headers["x-dead-letter-reason"] for m in dead_letters] == ["max_deliveries"]


# --- the consumed queue's own delivery limit --------------------------------------------------


async def declared_with(
    amqp_connection: aio_pika.abc.AbstractConnection, queue: str, limit: int
) -> None:
    channel = await amqp_connection.channel()
    await channel.declare_queue(queue, durable=True, arguments={**QUORUM, DELIVERY_LIMIT: limit})
    await channel.close()


def noop_consumer(store: PostgresStore, scope: str) -> IdempotentConsumer:
    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    return handler


async def test_an_existing_queue_whose_delivery_limit_is_below_the_budget_refuses_to_start(
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    await declared_with(amqp_connection, queues, 3)
    runner = RabbitRunner(noop_consumer(store, scope), queue=queues, max_deliveries=5)
    with pytest.raises(ConfigurationError, match=r"x-delivery-limit is 3.*budget is 5"):
        await runner.start()
    await runner.close_publisher()
    unlimited = RabbitRunner(noop_consumer(store, scope), queue=queues, max_deliveries=None)
    with pytest.raises(ConfigurationError, match="x-delivery-limit is 3"):
        await unlimited.start()
    await unlimited.close_publisher()


async def test_an_existing_queue_whose_delivery_limit_covers_the_budget_is_consumed(
    caplog: pytest.LogCaptureFixture,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    await declared_with(amqp_connection, queues, 50)
    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.default_exchange.publish(
        aio_pika.Message(b"{}", headers={"idempotency-key": "one"}), routing_key=queues
    )
    runner = RabbitRunner(noop_consumer(store, scope), queue=queues, max_deliveries=20)
    await run_until(runner, 1, 30)
    assert "keeps its x-delivery-limit of 50" in caplog.text


def test_declared_arguments_with_a_delivery_limit_below_the_budget_refuse_to_start(
    store: PostgresStore, queues: str, scope: str
) -> None:
    with pytest.raises(ConfigurationError, match="declared x-delivery-limit is 4"):
        RabbitRunner(
            noop_consumer(store, scope),
            queue=queues,
            queue_arguments={**QUORUM, DELIVERY_LIMIT: 4},
            max_deliveries=10,
        )


def test_rabbitmq_4_quorum_queues_are_declared_without_a_delivery_limit() -> None:
    """RabbitMQ 4 would give a quorum queue a limit of 20: -1 says none. RabbitMQ 3 has no
    default, and there -1 would drop a message at its first return: nothing is added."""
    assert declared_arguments(QUORUM, 4) == {**QUORUM, DELIVERY_LIMIT: -1}
    assert declared_arguments(QUORUM, None) == {**QUORUM, DELIVERY_LIMIT: -1}
    assert declared_arguments(QUORUM, 3) == QUORUM
    assert declared_arguments({**QUORUM, DELIVERY_LIMIT: 30}, 4) == {**QUORUM, DELIVERY_LIMIT: 30}
    assert declared_arguments({"x-queue-type": "classic"}, 4) == {"x-queue-type": "classic"}


async def test_a_store_outage_at_the_budget_holds_the_delivery_and_dead_letters_nothing(
    settings: Settings,
    pg_dsn: str,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queues: str,
    scope: str,
) -> None:
    """A delivery the broker has counted past ``max_deliveries`` meets a store it cannot reach:
    its attempts cannot be counted nor its record read, so it waits in hand; once the store is
    back it runs (it never ran before)."""
    from tests._broker import Outage

    calls = 0
    outage = await Outage.start(store, pg_dsn)

    @idempotent_consumer(outage.down, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1

    channel = await amqp_connection.channel(publisher_confirms=True)
    await channel.declare_queue(queues, durable=True, arguments=QUORUM)
    await channel.default_exchange.publish(
        aio_pika.Message(b"{}", headers={"idempotency-key": "held"}), routing_key=queues
    )
    for _ in range(2):
        await take_and_die(settings, queues, 1)
    runner = RabbitRunner(handler, queue=queues, max_deliveries=1)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def waited() -> bool:
            return runner.stats.retries >= 3

        await wait_until(waited, 30, "the delivery to wait for the store")
        assert runner.stats.dead_lettered == 0 and calls == 0
        outage.end()

        async def ran() -> bool:
            return runner.stats.processed >= 1

        await wait_until(ran, 30, "the delivery to run once the store is back")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert calls == 1 and runner.stats.dead_lettered == 0
    assert await drain(channel, f"{queues}.dlq") == []
