"""OpenTelemetry tracing of deliveries, with the SDK's in-memory exporter: one trace per message
continuing its producer's ``traceparent`` on Kafka and on RabbitMQ (real brokers, the library's
runners), the child spans and attributes, the key hashed by default; and tracing that is off,
or an OpenTelemetry that is not installed, changes nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from consumer_idem import (
    Ambiguous,
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    header,
    idempotent_consumer,
    tracing,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.rabbit import RabbitRunner
from handlers.payments import record_payment
from tests._payments import payment, wait_until
from tests.conftest import ROOT_DIR, unique
from tests.test_consumer_kafka import FAST

QUORUM = {"x-queue-type": "quorum"}


class Traces:
    """What the in-memory exporter saw, and a producer that starts traces the way an
    instrumented producer does (a PRODUCER span, its context injected into the headers)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests.producer")

    def produce(self, name: str = "send") -> tuple[dict[str, str], trace.SpanContext]:
        """Headers carrying a fresh producer span's ``traceparent``, and that span's context."""
        with self.tracer.start_as_current_span(name, kind=SpanKind.PRODUCER) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
        assert "traceparent" in carrier
        return carrier, span.get_span_context()

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def trace_of(self, context: trace.SpanContext) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.context.trace_id == context.trace_id]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return [
            s
            for s in self.spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id
        ]

    def named(self, spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
        return [s for s in spans if s.name == name]


@pytest.fixture
def traces() -> Iterator[Traces]:
    traces = Traces()
    tracing.configure(tracer_provider=traces.provider)
    yield traces
    tracing.configure()
    traces.provider.shutdown()


@pytest.fixture
def run_id() -> str:
    return f"tr{uuid.uuid4().hex[:8]}"


def ledger(store: PostgresStore, scope: str) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.2)
    )(record_payment)


def one(spans: list[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def step_names(traces: Traces, parent: ReadableSpan) -> list[str]:
    """The claim-engine and handler steps under a delivery or request span."""
    names = [s.name for s in traces.children(parent) if s.name.startswith("consumer_idem.")]
    return sorted(name for name in names if name != "consumer_idem.settle")


def assert_delivery(
    traces: Traces,
    producer: trace.SpanContext,
    *,
    decision: str,
    outcome: str | None,
    key: str | None,
) -> tuple[ReadableSpan, ReadableSpan]:
    """The delivery span continues the producer's trace (its parent is the producer span) and
    a settle span follows it; returns both."""
    spans = traces.trace_of(producer)
    delivery = one([s for s in spans if s.kind is SpanKind.CONSUMER])
    assert delivery.parent is not None and delivery.parent.span_id == producer.span_id
    a = attrs(delivery)
    assert a["consumer_idem.decision"] == decision
    assert a.get("consumer_idem.outcome") == outcome
    if key is not None:
        # hashed by default: the raw key is in no attribute of the trace
        assert a["consumer_idem.key"] == tracing.key_attribute(key)
        assert a["consumer_idem.key"].startswith("sha256:")
        assert all(key not in str(v) for s in spans for v in attrs(s).values())
    settle = one(traces.named(spans, "consumer_idem.settle"))
    assert settle.parent is not None and settle.parent.span_id == delivery.context.span_id
    return delivery, settle


# --- Kafka -----------------------------------------------------------------------------------


async def test_kafka_one_trace_per_message_continuing_the_producer(
    traces: Traces,
    settings: Settings,
    store: PostgresStore,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("traced")
    sent: list[tuple[str, trace.SpanContext]] = []
    bodies = [
        ("first", payment(run_id, 1)),
        ("second", payment(run_id, 2)),
        ("first", payment(run_id, 1)),  # the producer retried it: a new trace, a replay
        ("poison", b"not json"),  # dead-lettered: a publish on the settle path
    ]
    for key, body in bodies:
        carrier, producer = traces.produce()
        headers = [("idempotency-key", key.encode())]
        headers += [(k, v.encode()) for k, v in carrier.items()]
        await kafka_producer.send_and_wait(topic, value=body, headers=headers)
        sent.append((key, producer))

    runner = KafkaRunner(
        ledger(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= len(bodies)

        await wait_until(settled, 30, "every record settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await kafka_admin.delete_topics([f"{topic}.dlq"])

    for offset, (key, producer) in enumerate(sent):
        spans = traces.trace_of(producer)
        # one trace per message: nothing of another message's processing is in it
        assert {s.context.trace_id for s in spans} == {producer.trace_id}
        if key == "poison":
            # dead-lettered before any claim: no decision, no steps; its publish is traced
            delivery = one([s for s in spans if s.kind is SpanKind.CONSUMER])
            assert delivery.parent is not None and delivery.parent.span_id == producer.span_id
            a = attrs(delivery)
            assert a["consumer_idem.action"] == "dead_letter"
            assert a["consumer_idem.reason"] == "invalid_json"
            assert delivery.status.status_code is StatusCode.ERROR
            settle = one(traces.named(spans, "consumer_idem.settle"))
            publish = one(traces.children(settle))
            assert publish.name == f"send {topic}.dlq" and publish.kind is SpanKind.PRODUCER
            assert attrs(publish)["consumer_idem.publish"] == "dead_letter"
            assert attrs(settle)["consumer_idem.settled"] == "acked"
            continue
        duplicate = offset == 2
        delivery, settle = assert_delivery(
            traces,
            producer,
            decision="replay" if duplicate else "execute",
            outcome="replayed" if duplicate else "executed",
            key=key,
        )
        a = attrs(delivery)
        assert delivery.name == f"process {topic}"
        assert a["messaging.system"] == "kafka"
        assert a["messaging.destination.name"] == topic
        assert a["messaging.destination.partition.id"] == "0"
        assert a["messaging.kafka.offset"] == offset
        assert a["messaging.operation.type"] == "process"
        assert a["consumer_idem.scope"] == scope
        assert a["consumer_idem.action"] == "ack"
        if duplicate:  # the stored result answers: no handler, no commit
            assert step_names(traces, delivery) == ["consumer_idem.reserve"]
        else:
            assert step_names(traces, delivery) == [
                "consumer_idem.commit",
                "consumer_idem.handler",
                "consumer_idem.reserve",
            ]
            commit = one(traces.named(spans, "consumer_idem.commit"))
            assert attrs(commit)["consumer_idem.outcome"] == "executed"
        assert attrs(settle)["consumer_idem.settled"] == "acked"
        assert traces.children(settle) == []  # an ack publishes nothing


# --- RabbitMQ --------------------------------------------------------------------------------


@pytest.fixture
async def queue(settings: Settings) -> AsyncIterator[str]:
    name = unique("trq")
    yield name
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel()
        for q in (name, f"{name}.dlq", f"{name}.reconcile"):
            await channel.queue_delete(q)
    finally:
        await connection.close()


async def test_rabbit_one_trace_per_message_continuing_the_producer(
    traces: Traces,
    settings: Settings,
    store: PostgresStore,
    demo_tables: None,
    queue: str,
    run_id: str,
    scope: str,
) -> None:
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        if json.loads(message.body)["payment_id"].endswith("-pay-3"):
            raise Ambiguous("the gateway timed out")  # parked unknown: a notice is published
        return await record_payment(message, conn)

    consumer = idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), backoff=(0.05, 0.2)
    )(book)
    sent: list[tuple[str, str, trace.SpanContext]] = []
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments=QUORUM)
        for n, key in ((1, "one"), (2, "two"), (1, "one"), (3, "three")):
            carrier, producer = traces.produce()
            message_id = f"{run_id}-{len(sent)}"
            await channel.default_exchange.publish(
                aio_pika.Message(
                    payment(run_id, n),
                    headers={"idempotency-key": key, **carrier},
                    message_id=message_id,
                ),
                queue,
            )
            sent.append((key, message_id, producer))
    finally:
        await connection.close()

    runner = RabbitRunner(consumer, queue=queue, reconcile_queue=f"{queue}.reconcile")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:

        async def settled() -> bool:
            return runner.stats.processed >= len(sent)

        await wait_until(settled, 30, "every delivery settled")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)

    # the runner handles deliveries concurrently: either of the two "one"s may be the first
    decisions = {
        i: attrs(one([s for s in traces.trace_of(sent[i][2]) if s.kind is SpanKind.CONSUMER]))[
            "consumer_idem.decision"
        ]
        for i in (0, 2)
    }
    assert sorted(decisions.values()) == ["execute", "replay"], decisions
    for i, (key, message_id, producer) in enumerate(sent):
        assert {s.context.trace_id for s in traces.trace_of(producer)} == {producer.trace_id}
        if key == "three":
            delivery, settle = assert_delivery(
                traces, producer, decision="execute", outcome="unknown", key=key
            )
            assert attrs(delivery)["consumer_idem.reason"] == "unknown"
            assert delivery.status.status_code is StatusCode.ERROR  # parked: may have run
            handler = one(traces.named(traces.trace_of(producer), "consumer_idem.handler"))
            assert handler.status.status_code is StatusCode.ERROR
            assert any(e.name == "exception" for e in handler.events)
            publish = one(traces.children(settle))
            assert publish.kind is SpanKind.PRODUCER
            assert attrs(publish)["consumer_idem.publish"] == "notice"
            continue
        duplicate = decisions.get(i) == "replay"
        delivery, _ = assert_delivery(
            traces,
            producer,
            decision="replay" if duplicate else "execute",
            outcome="replayed" if duplicate else "executed",
            key=key,
        )
        a = attrs(delivery)
        assert delivery.name == f"process {queue}"
        assert a["messaging.system"] == "rabbitmq"
        assert a["messaging.destination.name"] == ""  # the default exchange
        assert a["messaging.rabbitmq.destination.routing_key"] == queue
        assert a["messaging.message.id"] == message_id
        assert isinstance(a["messaging.rabbitmq.message.delivery_tag"], int)
        expected = ["consumer_idem.reserve"]
        if not duplicate:
            expected = ["consumer_idem.commit", "consumer_idem.handler", "consumer_idem.reserve"]
        assert step_names(traces, delivery) == expected


# --- options, and tracing that is off --------------------------------------------------------


def delivery_for(key: str, body: bytes = b'{"n": 1}') -> ConsumerMessage:
    return ConsumerMessage(body, headers={"idempotency-key": key.encode()})


async def noop(message: ConsumerMessage, conn: asyncpg.Connection) -> dict[str, int]:
    await conn.execute("SELECT 1")
    return {"n": 1}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("truncate", "order-12…"),
        ("plain", "order-1234567"),
        ("omit", None),
        ("hash", "sha256:" + hashlib.sha256(b"order-1234567").hexdigest()[:8]),
    ],
)
async def test_the_key_attribute_follows_the_option(
    traces: Traces, store: PostgresStore, scope: str, mode: Any, expected: str | None
) -> None:
    tracing.configure(tracer_provider=traces.provider, key=mode, key_length=8)
    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(noop)
    await consumer.process(delivery_for("order-1234567"))
    delivery = one([s for s in traces.spans() if s.kind is SpanKind.CONSUMER])
    assert attrs(delivery).get("consumer_idem.key") == expected


async def test_tracing_off_makes_no_span_and_changes_no_verdict(
    traces: Traces, store: PostgresStore, scope: str
) -> None:
    consumer = idempotent_consumer(store, scope=scope, key=header("idempotency-key"))(noop)
    tracing.configure(enabled=False, tracer_provider=traces.provider)
    with traces.tracer.start_as_current_span("the caller's own span"):  # a parent is there
        first = await consumer.process(delivery_for("k1"))
        again = await consumer.process(delivery_for("k1"))
    assert [s.name for s in traces.spans()] == ["the caller's own span"]
    assert first.trace_context is None and again.trace_context is None
    assert (first.action, first.duplicate, again.duplicate) == ("ack", False, True)

    # no provider set at all (the API's default proxy): no span either, nothing recorded
    tracing.configure()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not tracing.active()
    unset = await consumer.process(delivery_for("k2"))
    assert unset.trace_context is None and unset.result == {"n": 1}
    assert [s.name for s in traces.spans()] == ["the caller's own span"]


def test_without_opentelemetry_installed_nothing_is_wrapped_and_deliveries_run(
    pg_dsn: str, store: PostgresStore
) -> None:
    """In a fresh interpreter where ``import opentelemetry`` fails: every module imports, no
    hook wraps anything (the undecorated functions run: zero overhead) and a delivery runs."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        sys.modules["opentelemetry"] = None  # import opentelemetry -> ImportError
        import asyncpg
        from consumer_idem import ConsumerMessage, PostgresStore, header, idempotent_consumer
        from consumer_idem import claim, consumer, http, tracing
        from consumer_idem.transports import kafka, rabbit, settle

        assert not tracing.AVAILABLE and not tracing.active()
        hooked = [
            consumer.IdempotentConsumer.process,
            consumer.IdempotentConsumer.execute,
            claim.TransactionalClaim.__aenter__,
            claim.TransactionalClaim.complete,
            claim.TwoPhaseClaim.reserve,
            http.IdempotencyMiddleware._run_app,
            settle.settle,
        ]
        assert not any(hasattr(f, "__wrapped__") for f in hooked), hooked

        async def main():
            pool = await asyncpg.create_pool(sys.argv[1], min_size=1, max_size=2)
            store = PostgresStore(pool, schema=sys.argv[2])

            async def handler(message, conn):
                return {"n": await conn.fetchval("SELECT 1")}

            ledger = idempotent_consumer(store, scope=sys.argv[3], key=header("k"))(handler)
            message = ConsumerMessage(b"{}", headers={"k": b"absent"})
            first = await ledger.process(message)
            again = await ledger.process(message)
            assert first.result == {"n": 1} and not first.duplicate, first
            assert again.duplicate and again.trace_context is None, again
            await pool.close()
            print("ok")

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, pg_dsn, store.schema, unique("absent")],
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ROOT_DIR},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


async def test_under_faststreams_telemetry_the_delivery_span_is_its_internal_child(
    traces: Traces, store: PostgresStore, scope: str
) -> None:
    """FastStream's own telemetry middleware already continues the producer's trace with a
    CONSUMER span: the delivery span nests under it (INTERNAL), with its steps and settle."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
    from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware

    from consumer_idem.faststream import Idempotency, IdempotentConnection

    broker = KafkaBroker(middlewares=[KafkaTelemetryMiddleware(tracer_provider=traces.provider)])
    router = KafkaRouter(
        middlewares=[Idempotency(store, broker=broker, scope=scope, key=header("idempotency-key"))]
    )

    @router.subscriber("in", group_id="g", ack_policy=AckPolicy.MANUAL)
    async def handle(data: dict[str, Any], conn: IdempotentConnection) -> None:
        await conn.execute("SELECT 1")

    broker.include_router(router)
    async with TestKafkaBroker(broker) as test_broker:
        await test_broker.publish({"n": 1}, "in", headers={"idempotency-key": scope})

    theirs = one([s for s in traces.spans() if s.kind is SpanKind.CONSUMER])
    ours = one([s for s in traces.children(theirs) if s.name == "process in"])
    assert ours.kind is SpanKind.INTERNAL
    assert attrs(ours)["consumer_idem.decision"] == "execute"
    assert attrs(ours)["consumer_idem.outcome"] == "executed"
    assert step_names(traces, ours) == [
        "consumer_idem.commit",
        "consumer_idem.handler",
        "consumer_idem.reserve",
    ]
    settle = one(traces.named(traces.spans(), "consumer_idem.settle"))
    assert settle.parent is not None and settle.parent.span_id == ours.context.span_id
    assert attrs(settle)["consumer_idem.settled"] == "acked"


def test_a_global_provider_set_after_start_up_is_used_within_a_second() -> None:
    """With no provider, whether spans are made is asked of the API at most once a second (it
    reads the environment each time): one set later, while deliveries run, is used from then."""
    script = textwrap.dedent(
        """
        import time
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from consumer_idem import tracing

        assert not tracing.active()
        trace.set_tracer_provider(TracerProvider())
        deadline = time.monotonic() + 1.5
        while not tracing.active():
            assert time.monotonic() < deadline, "the provider set later was never used"
            time.sleep(0.05)
        print("seen")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "seen"
