"""How deep the user's handler runs below the transport's worker, counted in library frames.

A *library frame* is a frame whose file is under ``consumer_idem/``, strictly between the
handler's frame and the worker's. The *worker* is the coroutine a transport's task runs for the
delivery: for a runner, the outermost frame under ``consumer_idem/`` on the handler's stack
(``inspect.stack()`` inside a handler shows every awaiting coroutine up to the task's root);
for the plain decorator, the caller's own coroutine, so every library frame counts. Each frame
is a layer a reader steps through from delivery to handler, and a cost paid per message; the
library allows itself at most :data:`MOST`.
"""

from __future__ import annotations

import inspect
import os

import aio_pika
import asyncpg
from aiokafka import AIOKafkaProducer

import consumer_idem
from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.rabbit import RabbitRunner
from tests._payments import wait_until
from tests._runners import Running
from tests.conftest import delete_queues, unique

#: the most library frames a handler may run below its worker
MOST = 6

LIBRARY = os.path.dirname(os.path.abspath(consumer_idem.__file__)) + os.sep


class Depth:
    """Inside a handler, :meth:`measure` records the library frames below the worker."""

    def __init__(self) -> None:
        #: per call: the worker's function name (None: no library frame is the worker) and
        #: the library frames between it and the handler, innermost first
        self.seen: list[tuple[str | None, list[str]]] = []

    def measure(self, worker_in_library: bool) -> None:
        stack = inspect.stack(context=0)[2:]  # this method's frame and the handler's left out
        inside = [os.path.abspath(f.filename).startswith(LIBRARY) for f in stack]
        names = [f"{f.function} ({os.path.basename(f.filename)})" for f in stack]
        if worker_in_library:
            root = max(i for i, lib in enumerate(inside) if lib)  # the task's root coroutine
            worker: str | None = stack[root].function
        else:
            root = inside.index(False)  # the first frame outside: the caller
            worker = None
        below = [n for n, lib in zip(names[:root], inside[:root], strict=True) if lib]
        self.seen.append((worker, below))


async def test_the_plain_decorator_runs_its_handler_at_most_six_frames_below_its_caller(
    store: PostgresStore, scope: str
) -> None:
    depth = Depth()

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        depth.measure(worker_in_library=False)

    await handler.process(ConsumerMessage(b"{}", headers={"idempotency-key": b"k1"}))
    [(_, frames)] = depth.seen
    assert len(frames) <= MOST, frames


async def test_a_kafka_partition_worker_runs_the_handler_at_most_six_frames_below_it(
    settings: Settings,
    store: PostgresStore,
    kafka_topic_factory: object,
    kafka_producer: AIOKafkaProducer,
    running: Running,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("depth")  # type: ignore[operator]
    depth = Depth()

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        depth.measure(worker_in_library=True)

    await kafka_producer.send_and_wait(topic, b"{}", headers=[("idempotency-key", b"k1")])
    runner = running.start(
        KafkaRunner(
            handler,
            topics=[topic],
            group_id=unique("depth"),
            bootstrap_servers=settings.kafka_bootstrap,
            outbox_relay=None,
        )
    )

    async def handled() -> bool:
        running.died()
        return runner.stats.processed >= 1

    await wait_until(handled, 60, "the record to be handled")
    [(worker, frames)] = depth.seen
    assert worker == "work", (worker, frames)  # the partition's worker
    assert len(frames) <= MOST, frames


async def test_a_rabbitmq_delivery_worker_runs_the_handler_at_most_six_frames_below_it(
    settings: Settings,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    running: Running,
    scope: str,
) -> None:
    queue = unique("depth")
    depth = Depth()

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        depth.measure(worker_in_library=True)

    channel = await amqp_connection.channel()
    try:
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", headers={"idempotency-key": "k1"}), routing_key=queue
        )
        runner = running.start(RabbitRunner(handler, queue=queue, url=settings.amqp_url))

        async def handled() -> bool:
            running.died()
            return runner.stats.processed >= 1

        await wait_until(handled, 60, "the delivery to be handled")
        await running.stop_all()
    finally:
        await delete_queues(settings, queue, f"{queue}.dlq", f"{queue}.reconcile")
    [(worker, frames)] = depth.seen
    assert worker == "handle", (worker, frames)  # the delivery's worker
    assert len(frames) <= MOST, frames
