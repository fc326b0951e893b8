"""Typed results through FastStream's ``Idempotency``, Kafka and RabbitMQ (FastStream's test
brokers on the real store): the first run and a duplicate hand the hooks, and publish, an
equal value of the type the handler's return annotation names; a changed model dead-letters
the duplicate naming scope and key."""

from __future__ import annotations

from typing import Annotated, Any

import aio_pika
import pytest
from aiokafka import AIOKafkaProducer
from faststream import AckPolicy, Context, Response
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.rabbit import (
    QueueType,
    RabbitBroker,
    RabbitQueue,
    RabbitRouter,
    TestRabbitBroker,
)

from consumer_idem import PostgresStore, Verdict, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import Idempotency, IdempotencyConfigError
from tests._payments import wait_until
from tests._typed_cases import CASES, Charge, ChargeV2, annotated, same
from tests.conftest import unique

RawMessage = Annotated[Any, Context("message")]
TRANSPORTS = ["kafka", "rabbit"]


def broker_of(transport: str) -> tuple[Any, Any, dict[str, Any]]:
    if transport == "kafka":
        return KafkaBroker(), TestKafkaBroker, {"group_id": "g", "ack_policy": AckPolicy.MANUAL}
    return RabbitBroker(), TestRabbitBroker, {"ack_policy": AckPolicy.MANUAL}


class Seen:
    def __init__(self) -> None:
        self.executed: list[Verdict] = []
        self.replayed: list[Verdict] = []
        self.out: list[bytes] = []
        self.dead: list[dict[str, Any]] = []


def app(
    transport: str, store: PostgresStore, scope: str, annotation: Any, value: Any, **options: Any
) -> tuple[Any, Any, Seen]:
    broker, tester, subscribe = broker_of(transport)
    seen = Seen()
    idem = Idempotency(
        store,
        broker=broker,
        scope=scope,
        key=header("idempotency-key"),
        backoff=(0.01, 0.05),
        on_execute=seen.executed.append,
        on_replay=seen.replayed.append,
        **options,
    )

    async def handle(data: Any) -> Any:
        return value

    router = (KafkaRouter if transport == "kafka" else RabbitRouter)(middlewares=[idem])
    router.subscriber("in", **subscribe)(router.publisher("out")(annotated(handle, annotation)))
    broker.include_router(router)

    @broker.subscriber("out")
    async def collect(message: RawMessage) -> None:
        seen.out.append(message.body)

    @broker.subscriber("in.dlq")
    async def dead(message: RawMessage) -> None:
        seen.dead.append(dict(message.headers))

    return broker, tester, seen


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_duplicate_hands_the_hooks_the_annotated_type_and_publishes_the_same_bytes(
    store: PostgresStore, scope: str, transport: str, case: str
) -> None:
    annotation, value = CASES[case]
    broker, tester, seen = app(transport, store, scope, annotation, value)
    async with tester(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    assert len(seen.executed) == 1 and len(seen.replayed) == 1, (seen.executed, seen.replayed)
    same(value, seen.executed[0].result)
    same(seen.executed[0].result, seen.replayed[0].result)
    assert len(seen.out) == 2 and seen.out[0] == seen.out[1]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_explicit_result_type_wins_over_the_annotation(
    store: PostgresStore, scope: str, transport: str
) -> None:
    value = CASES["model"][1]
    broker, tester, seen = app(transport, store, scope, Any, value, result_type=Charge)
    async with tester(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    same(value, seen.replayed[0].result)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_changed_model_dead_letters_the_duplicate_naming_scope_and_key(
    store: PostgresStore, scope: str, transport: str
) -> None:
    value = CASES["model"][1]
    broker, tester, seen = app(transport, store, scope, Charge, value)
    async with tester(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    broker, tester, seen = app(transport, store, scope, ChargeV2, value)  # the next release
    async with tester(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    assert seen.out == [] and seen.replayed == []
    (headers,) = seen.dead
    assert headers["x-dead-letter-reason"] == "stored_result_mismatch"
    error = str(headers.get("x-dead-letter-error", ""))
    assert scope in error and "'k'" in error, headers


async def test_a_batch_subscriber_hands_the_hooks_its_element_type(
    store: PostgresStore, scope: str
) -> None:
    value = CASES["model"][1]
    executed: list[Verdict] = []
    replayed: list[Verdict] = []
    broker = KafkaBroker()
    idem = Idempotency(
        store,
        broker=broker,
        scope=scope,
        key=header("idempotency-key"),
        on_execute=executed.append,
        on_replay=replayed.append,
    )

    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("batch-in", batch=True, group_id="g", ack_policy=AckPolicy.MANUAL)
    async def handle(bodies: list[Any]) -> list[Charge]:
        return [value for _ in bodies]

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        await broker.publish_batch(
            {"n": 1}, {"n": 2}, topic="batch-in", headers={"idempotency-key": "k"}
        )
        await broker.publish_batch({"n": 1}, topic="batch-in", headers={"idempotency-key": "k"})
    assert len(executed) == 1 and len(replayed) >= 1
    for verdict in [*executed, *replayed]:
        same(value, verdict.result)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_handler_annotated_with_faststreams_response_replays_it_as_published(
    store: PostgresStore, scope: str, transport: str
) -> None:
    value = Response({"n": 1}, headers={"x-receipt": "r1"})
    broker, tester, seen = app(transport, store, scope, Response, value)
    async with tester(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    assert len(seen.out) == 2 and seen.out[0] == seen.out[1]
    first, again = seen.executed[0].result, seen.replayed[0].result
    assert isinstance(again, Response) and again.body == first.body == {"n": 1}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unreadable_return_annotation_refuses_the_first_delivery(
    store: PostgresStore, scope: str, transport: str
) -> None:
    class Opaque:
        pass

    broker, tester, seen = app(transport, store, scope, Opaque, None)
    with pytest.raises(IdempotencyConfigError, match="Opaque"):
        async with tester(broker):
            await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k"})
    assert seen.executed == []


# --- the real brokers -----------------------------------------------------------------------


async def test_kafka_and_rabbitmq_brokers_replay_the_model_a_handler_returned(
    settings: Settings,
    store: PostgresStore,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    """One key delivered twice through each real broker: the hooks get an equal `Charge` both
    times, and the subscriber publishes the same bytes."""
    value = CASES["model"][1]
    seen: dict[str, list[Any]] = {"kafka": [], "rabbit": []}

    async def run(transport: str, broker: Any, router: Any, source: Any, send: Any) -> None:
        idem = Idempotency(
            store,
            broker=broker,
            scope=unique("typed"),
            key=header("idempotency-key"),
            backoff=(0.05, 0.5),
            on_execute=lambda v: seen[transport].append(v.result),
            on_replay=lambda v: seen[transport].append(v.result),
        )
        router = router(middlewares=[idem])
        extra = {"group_id": unique("g"), "auto_offset_reset": "earliest"}

        @router.subscriber(
            source, ack_policy=AckPolicy.MANUAL, **(extra if transport == "kafka" else {})
        )
        async def handle(data: Any) -> Charge:
            return value  # type: ignore[no-any-return]

        broker.include_router(router)
        await send()
        await broker.start()
        try:

            async def both() -> bool:
                return len(seen[transport]) >= 2

            await wait_until(both, 60, f"two {transport} deliveries settled")
        finally:
            await broker.stop()
        first, again = seen[transport]
        same(value, first)
        same(first, again)

    topic = await kafka_topic_factory("fstyped")

    async def send_kafka() -> None:
        for _ in range(2):
            await kafka_producer.send_and_wait(
                topic, b'{"n": 1}', headers=[("idempotency-key", b"k")]
            )

    kafka = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    await run("kafka", kafka, KafkaRouter, topic, send_kafka)

    queue = unique("fstyped")
    channel = await amqp_connection.channel(publisher_confirms=True)
    try:
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})

        async def send_rabbit() -> None:
            for _ in range(2):
                await channel.default_exchange.publish(
                    aio_pika.Message(b'{"n": 1}', headers={"idempotency-key": "k"}),
                    routing_key=queue,
                )

        rabbit = RabbitBroker(settings.amqp_url)
        source = RabbitQueue(queue, queue_type=QueueType.QUORUM)
        await run("rabbit", rabbit, RabbitRouter, source, send_rabbit)
    finally:
        await channel.queue_delete(queue)
        await channel.queue_delete(f"{queue}.dlq")
        await channel.close()


async def test_a_real_broker_with_an_unreadable_return_annotation_refuses_to_start(
    settings: Settings, store: PostgresStore, scope: str
) -> None:
    class Opaque:
        pass

    broker = RabbitBroker(settings.amqp_url)
    idem = Idempotency(store, broker=broker, scope=scope, key=header("idempotency-key"))
    router = RabbitRouter(middlewares=[idem])

    async def handle(data: Any) -> Any:
        return None

    router.subscriber(unique("opaque"), ack_policy=AckPolicy.MANUAL)(annotated(handle, Opaque))
    broker.include_router(router)
    try:
        with pytest.raises(IdempotencyConfigError, match=r"refusing to start.*Opaque"):
            await broker.start()
    finally:
        await broker.stop()
