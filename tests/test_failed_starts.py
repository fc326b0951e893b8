"""A runner whose start fails leaves nothing open behind it, and a RabbitMQ queue that exists
with other arguments is one clear error naming ``declare=False``, on the real brokers."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import uuid
import warnings
from typing import Any

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
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.rabbit import RabbitRunner
from tests.conftest import unique


def consumer(store: PostgresStore, scope: str) -> IdempotentConsumer:
    async def handle(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        return {"n": message.json()["n"]}

    return idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(handle)


def rabbit_connections(name: str) -> int:
    """Connections RabbitMQ holds open under this client-given name (read-only listing)."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "client_properties"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return listed.stdout.count(f'{{"connection_name","{name}"}}')


async def no_rabbit_connections(name: str) -> None:
    for _ in range(20):  # the broker lists a closed connection for a moment
        if rabbit_connections(name) == 0:
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"connections named {name} still open")


async def test_a_classic_queue_where_the_runner_declares_quorum_is_one_line_and_no_leak(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    amqp_connection: aio_pika.abc.AbstractConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue, name = unique("classic"), unique("runner")
    channel = await amqp_connection.channel()
    await channel.declare_queue(queue, durable=True)  # classic: the runner declares quorum
    url = f"{settings.amqp_url}?name={name}"
    try:
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}', headers={"idempotency-key": "k1"}), routing_key=queue
        )
        runner = RabbitRunner(consumer(store, scope), queue=queue, url=url)
        with pytest.raises(ConfigurationError) as refused:
            await runner.start()
        message = str(refused.value)
        assert "\n" not in message and "declare=False" in message
        assert "x-queue-type" in message and refused.value.__suppress_context__
        await no_rabbit_connections(name)
        await asyncio.sleep(0.5)  # a robust connection left open would be reconnecting now
        assert not [r for r in caplog.records if r.exc_info], "tracebacks were logged"
        await no_rabbit_connections(name)

        # the remedy named in the error works, and the message was kept
        runner = RabbitRunner(consumer(store, scope), queue=queue, url=url, declare=False)
        stop = asyncio.Event()
        running = asyncio.create_task(runner.run(stop))
        for _ in range(200):
            if runner.stats.processed:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(running, 30)
        record = await store.get(scope, "k1")
        assert record is not None and record.result == {"n": 1}
        await no_rabbit_connections(name)
    finally:
        await channel.queue_delete(queue)
        await channel.close()


def kafka_sockets() -> int:
    """This process's established TCP connections to Kafka's port."""
    port = 9092
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            for row in rows.read().splitlines()[1:]:
                fields = row.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[3] == "01" and fields[9] in mine:
                    count += 1
    return count


#: a start that fails before anything connects, and one that fails after the producer did
KAFKA_FAILURES = {
    "unreachable": {"bootstrap_servers": "127.0.0.1:1"},
    "consumer_refused": {
        "consumer_options": {
            "security_protocol": "SASL_PLAINTEXT",  # the broker speaks PLAINTEXT: refused
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": "x",
            "sasl_plain_password": "y",
        }
    },
}


@pytest.mark.parametrize("failure", sorted(KAFKA_FAILURES))
async def test_a_failed_kafka_start_closes_its_consumer_and_producer(
    failure: str, settings: Settings, store: PostgresStore, scope: str
) -> None:
    before = kafka_sockets()
    options: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap}
    options.update(KAFKA_FAILURES[failure])
    runner = KafkaRunner(
        consumer(store, scope),
        topics=[unique("never")],
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        **options,
    )
    with pytest.raises(Exception):  # noqa: B017 - aiokafka's own connection error
        await asyncio.wait_for(runner.start(), 60)
    assert kafka_sockets() == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del runner
        gc.collect()
    unclosed = [str(w.message) for w in caught if "Unclosed" in str(w.message)]
    assert unclosed == []
