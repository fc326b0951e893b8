"""The outbox under faults: a process SIGKILLed between its COMMIT and the dispatch (the relay
sends it), and a broker outage (the messages wait in Postgres, then all of them go)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest

from consumer_idem import OutcomeKind, PostgresStore, run_transactional
from consumer_idem.cli.settings import Settings
from consumer_idem.outbox import OutboxRelay, OutboxService, outbox_for
from consumer_idem.transports.kafka import KafkaOutboxSender
from consumer_idem.transports.rabbit import RabbitOutboxSender
from tests._outbox import FP, Proxy, header, outbox_store, producer, rows, sent_keys
from tests._payments import read_topic, wait_until
from tests.conftest import ROOT_DIR


@pytest.fixture(autouse=True)
async def _migrated(store: PostgresStore) -> None:
    """Every test here runs on the session's migrated schema (through a store of its own)."""


async def test_sigkill_between_commit_and_dispatch_the_relay_sends_it(
    settings: Settings, pg_dsn: str, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    topic = await kafka_topic_factory("outbox-crash")
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests._outbox",
        pg_dsn,
        scope,
        "pay-1",
        topic,
        cwd=ROOT_DIR,
        env=dict(os.environ, CONSUMER_IDEM_KAFKA_BOOTSTRAP=settings.kafka_bootstrap),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=60)
    assert child.returncode == -9, out  # SIGKILLed, as the dispatch began
    assert json.loads(out.decode().splitlines()[-1]) == {"event": "dispatching", "messages": 1}

    store = outbox_store(pg_pool)
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status.value == "completed"  # the unit committed
    assert [r["status"] for r in await rows(store, scope)] == ["pending"]
    assert await read_topic(settings.kafka_bootstrap, topic, 1, within=3) == []  # not sent

    async with producer(settings.kafka_bootstrap) as p:
        report = await OutboxRelay(store, KafkaOutboxSender(p), scopes=[scope]).run_once()
    assert report.sent == 1
    records = await read_topic(settings.kafka_bootstrap, topic, 2, within=5)
    assert len(records) == 1
    assert json.loads(records[0].value) == {"payment_id": "pay-1", "booked": True}
    assert (
        records[0].key == b"pay-1"
        and header(records[0]) == (await sent_keys(store, scope))["pay-1"]
    )
    assert [r["status"] for r in await rows(store, scope)] == ["sent"]


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))


async def test_a_broker_outage_delays_but_loses_nothing(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    queue_name: str,
    amqp_connection: aio_pika.abc.AbstractConnection,  # RabbitMQ down fails the test here
) -> None:
    """RabbitMQ, reached through a proxy the test cuts: units keep committing during the
    outage, their messages wait (failed dispatches, then the relay's retries), and once the
    broker is back every one of them arrives."""
    broker = urlsplit(settings.amqp_url)
    proxy = Proxy(broker.hostname or "127.0.0.1", broker.port or 5672)
    port = await proxy.start()
    store = outbox_store(pg_pool, relay_after=0.5)
    direct = amqp_connection
    connection = await aio_pika.connect_robust(_via(settings.amqp_url, port), reconnect_interval=1)
    sender = RabbitOutboxSender(connection, declare=True)

    async def book(conn: asyncpg.Connection, n: int) -> None:
        await conn.execute("SELECT 1")
        outbox_for(conn).publish(queue_name, {"n": n})

    async def unit(n: int) -> None:
        outcome = await run_transactional(store, scope, f"u{n}", FP, lambda c: book(c, n))
        assert outcome.kind is OutcomeKind.EXECUTED

    async def pending() -> int:
        return sum(1 for r in await rows(store, scope) if r["status"] == "pending")

    try:
        async with OutboxService(
            store, sender, scopes=[scope], relay_interval=0.5, send_timeout=2.0
        ) as service:
            await unit(0)
            assert service.dispatcher is not None and await service.dispatcher.drain(10)
            assert await pending() == 0

            await proxy.cut()
            for n in range(1, 21):
                await unit(n)  # Postgres is up: the units commit, their messages wait
            await asyncio.sleep(3.0)  # dispatch and relay passes fail meanwhile
            waiting = [r for r in await rows(store, scope) if r["status"] == "pending"]
            assert len(waiting) == 20
            assert all(r["last_error"] for r in waiting), [r["last_error"] for r in waiting]

            await proxy.restore()

            async def none_pending() -> bool:
                return await pending() == 0

            await wait_until(none_pending, 90, "the relay to send what the outage held back")
        channel = await direct.channel()
        queue = await channel.declare_queue(queue_name, passive=True)
        keys: list[str] = []
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            keys.append(str((message.headers or {})["idempotency-key"]))
            assert message.message_id == keys[-1]
        assert len(keys) >= 21  # at least once
        expected = await sent_keys(store, scope)
        assert set(keys) == {expected[f"u{n}"] for n in range(21)}
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
        await proxy.close()
