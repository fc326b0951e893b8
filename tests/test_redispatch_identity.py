"""A re-dispatched original runs under the key of the original, on every transport.

"Not executed" re-dispatches the original message of an ``unknown`` record. If the copy reached
the consumer under another idempotency key, the work would run as a *new* unit of work: with a
new downstream key the gateway cannot deduplicate, so one payment is charged twice. The key
strategies read the AMQP ``message_id`` (the default on RabbitMQ), the Kafka coordinates, or
headers; so the copy carries the original's properties, record key and coordinates.

Also here: the loop of a resolver that answers "not executed" while every re-run ends
``unknown`` again is bounded (``max_redispatches``), and handed to the operator.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from types import SimpleNamespace
from typing import Any

import aio_pika
import asyncpg
from aiokafka import AIOKafkaProducer, ConsumerRecord

from consumer_idem import (
    Action,
    Ambiguous,
    Attempt,
    ConsumerMessage,
    NotExecuted,
    PostgresStore,
    Status,
    Verdict,
    header,
    idempotent_consumer,
    kafka_coordinates,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.notice import decode_notice, encode_notice
from consumer_idem.operations.reconcile import Reconciler
from consumer_idem.testing import MemoryTransport, deliver
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.kafka import to_message as kafka_message
from consumer_idem.transports.rabbit import RabbitRunner
from consumer_idem.types import Outcome, OutcomeKind, Record
from tests._payments import wait_until
from tests._runners import Running
from tests.conftest import unique
from tests.test_consumer_kafka import FAST


async def no_charge(record: Record) -> Any:
    return NotExecuted("gateway: no charge for that key")


async def records_in(pool: asyncpg.Pool, store: PostgresStore, scope: str) -> list[str]:
    rows = await pool.fetch(f"SELECT key FROM {store.table} WHERE scope = $1", scope)
    return [r["key"] for r in rows]


# --- RabbitMQ: the AMQP properties (message_id: the default key) ---------------------------------


async def test_rabbit_redispatch_runs_under_the_original_message_id(
    settings: Settings, store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    queue = unique("rid")
    reconcile = f"{queue}.reconcile"
    runs: list[dict[str, Any]] = []

    @idempotent_consumer(store, scope=scope, mode="two_phase")  # key: the AMQP message_id
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raw = message.raw
        runs.append(
            {
                "key": attempt.key,
                "downstream": attempt.downstream_key,
                "message_id": raw.message_id,
                "correlation_id": raw.correlation_id,
                "content_type": raw.content_type,
                "type": raw.type,
                "app_id": raw.app_id,
                "trace": (raw.headers or {}).get("trace"),
            }
        )
        if len(runs) == 1:
            raise Ambiguous("gateway timed out")
        return {"charged": True}

    running = Running()
    running.start(RabbitRunner(charge, queue=queue, reconcile_queue=reconcile))
    reconciler = Reconciler(store, no_charge, scopes=[scope], redispatch_grace=0)
    rec_runner = RabbitRunner(
        reconciler,
        queue=reconcile,
        reconcile_queue=reconcile,
        dead_letter_queue=f"{reconcile}.operator",
    )
    reconciler.attach(rec_runner)
    running.start(rec_runner)
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        await channel.default_exchange.publish(
            aio_pika.Message(
                b'{"amount": 10}',
                message_id="order-77",
                correlation_id="corr-77",
                content_type="application/json",
                type="charge.requested",
                app_id="shop",
                headers={"trace": "t-77"},
            ),
            routing_key=queue,
        )

        async def ran_twice() -> bool:
            return len(runs) >= 2

        await wait_until(ran_twice, 30, "the re-dispatched copy to run")
        await asyncio.sleep(1.0)  # nothing else arrives
    finally:
        await running.stop_all()
        channel = await connection.channel()
        for name in (queue, f"{queue}.dlq", reconcile, f"{reconcile}.operator"):
            await channel.queue_delete(name)
        await connection.close()
    first, copy = runs
    assert copy["key"] == "order-77", "the copy ran under a new key: a second charge"
    assert copy["downstream"] == first["downstream"]  # the gateway can deduplicate
    assert copy == first  # every property and header the handler reads is the original's
    assert len(runs) == 2
    record = await store.get(scope, "order-77")
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    assert await records_in(pg_pool, store, scope) == ["order-77"]


# --- Kafka: the record key (partition) and the coordinates (kafka_coordinates()) ---------------


async def test_kafka_redispatch_keeps_the_record_key_and_the_original_coordinates(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("rid", partitions=4)
    reconcile = await kafka_topic_factory("rid.rec")
    runs: list[tuple[str, int | None, int | None, bytes | None]] = []

    @idempotent_consumer(store, scope=scope, key=kafka_coordinates(), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        runs.append((attempt.key, message.partition, message.offset, message.record_key))
        if len(runs) == 1:
            raise Ambiguous("gateway timed out")
        return {"charged": True}

    running = Running()
    running.start(
        KafkaRunner(
            charge,
            topics=[topic],
            group_id=f"{topic}-g",
            reconcile_topic=reconcile,
            consumer_options=FAST,
        )
    )
    reconciler = Reconciler(store, no_charge, scopes=[scope], redispatch_grace=0)
    rec_runner = KafkaRunner(
        reconciler,
        topics=[reconcile],
        group_id=f"{reconcile}-g",
        reconcile_topic=reconcile,
        dead_letter_topic=f"{reconcile}.operator",
        consumer_options=FAST,
    )
    reconciler.attach(rec_runner)
    running.start(rec_runner)
    try:
        await kafka_producer.send_and_wait(
            topic, value=b'{"amount": 5}', key=b"customer-42", headers=[("trace", b"t-1")]
        )

        async def ran_twice() -> bool:
            return len(runs) >= 2

        await wait_until(ran_twice, 40, "the re-dispatched copy to run")
        await asyncio.sleep(1.0)
    finally:
        await running.stop_all()
    (key, partition, offset, record_key), copy = runs
    assert copy[0] == key, "the copy ran under a new key (its own coordinates)"
    assert record_key == copy[3] == b"customer-42"  # the same record key...
    assert copy[1] == partition  # ...so the same partition
    assert copy[2] != offset  # a new record, identified by the original's coordinates
    assert len(runs) == 2
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    assert await records_in(pg_pool, store, scope) == [key]


# --- FastStream: both re-dispatches restore the same -------------------------------------------


class CapturingBroker:
    """Stands in for a connected FastStream broker: records what is published."""

    def __init__(self) -> None:
        self.published: list[tuple[Any, str, dict[str, Any]]] = []

    async def publish(self, body: Any, destination: str, **options: Any) -> None:
        self.published.append((body, destination, options))

    async def declare_queue(self, queue: Any) -> None:
        pass


def parked_verdict(scope: str, key: str) -> Verdict:
    outcome = Outcome(OutcomeKind.UNKNOWN, scope, key, parked_now=True)
    return Verdict(Action.ACK, scope, key, outcome, reason="unknown", reconcile=True)


async def test_faststream_rabbit_redispatch_restores_the_amqp_properties(
    store: PostgresStore, scope: str
) -> None:
    from faststream.rabbit import RabbitBroker

    from consumer_idem.faststream import Idempotency, _Settler
    from consumer_idem.transports.rabbit import to_message

    idem = Idempotency(store, broker=RabbitBroker(), scope=scope, declare=False)
    raw = SimpleNamespace(
        body=b'{"amount": 10}',
        headers={"trace": "t-77", "x-delivery-count": 3},
        message_id="order-77",
        correlation_id="corr-77",
        content_type="application/json",
        content_encoding=None,
        type="charge.requested",
        app_id="shop",
        reply_to=None,
        priority=None,
        timestamp=None,
    )
    incoming = to_message(raw)  # type: ignore[arg-type]
    settler = _Settler(idem, None, incoming, "payments")
    verdict = parked_verdict(scope, "order-77")
    body = settler.notice_body(None, verdict, True)  # type: ignore[arg-type]
    notice = decode_notice(ConsumerMessage(body))
    broker = CapturingBroker()
    idem.transport.broker = broker  # type: ignore[attr-defined]
    assert await idem.redispatch(notice)
    ((body, destination, options),) = broker.published
    assert (body, destination) == (b'{"amount": 10}', "payments")
    assert options["message_id"] == "order-77"
    assert options["correlation_id"] == "corr-77"
    assert options["content_type"] == "application/json"
    assert options["message_type"] == "charge.requested"
    assert options["headers"] == {"trace": "t-77"}  # not the broker's delivery count
    assert options["persist"] is True and options["mandatory"] is True


async def test_faststream_kafka_redispatch_restores_the_record_key_and_coordinates(
    store: PostgresStore, scope: str
) -> None:
    from faststream.kafka import KafkaBroker

    from consumer_idem.faststream import Idempotency, _Settler

    idem = Idempotency(store, broker=KafkaBroker(), scope=scope, key=kafka_coordinates())
    record: ConsumerRecord[bytes, bytes] = ConsumerRecord(
        topic="orders",
        partition=2,
        offset=41,
        timestamp=0,
        timestamp_type=0,
        key=b"customer-42",
        value=b'{"amount": 5}',
        checksum=None,
        serialized_key_size=11,
        serialized_value_size=13,
        headers=[("trace", b"t-1")],
    )
    settler = _Settler(idem, None, kafka_message(record), "orders")
    verdict = parked_verdict(scope, "orders/2/41")
    body = settler.notice_body(None, verdict, True)  # type: ignore[arg-type]
    notice = decode_notice(ConsumerMessage(body))
    broker = CapturingBroker()
    idem.transport.broker = broker  # type: ignore[attr-defined]
    assert await idem.redispatch(notice)
    ((body, topic, options),) = broker.published
    assert (body, topic, options["key"]) == (b'{"amount": 5}', "orders", b"customer-42")
    headers = {k: v.encode() for k, v in options["headers"].items()}
    copy = ConsumerMessage(body, headers, topic="orders", partition=0, offset=99)
    assert kafka_coordinates()(copy) == "orders/2/41"  # the original's key
    assert headers["trace"] == b"t-1"


# --- notices written before these fields existed ----------------------------------------------


def test_an_old_notice_still_decodes_and_redispatches() -> None:
    from consumer_idem.transports.rabbit import redispatch_message

    old = json.dumps(
        {
            "scope": "s",
            "key": "k",
            "reason": "read timeout",
            "source": "payments",
            "body_b64": base64.b64encode(b"{}").decode(),
            "headers_b64": {"idempotency-key": base64.b64encode(b"k").decode()},
        }
    ).encode()
    notice = decode_notice(ConsumerMessage(old))
    assert notice.original and notice.record_key is None and notice.properties == {}
    message = redispatch_message(notice)
    assert message.body == b"{}" and message.headers == {"idempotency-key": "k"}
    assert message.message_id is None


def test_a_notice_round_trips_everything_a_key_strategy_reads() -> None:
    original = ConsumerMessage(
        b"{}",
        {"idempotency-key": b"k", "x-delivery-count": b"2"},
        message_id="m-1",
        topic="orders",
        partition=1,
        offset=5,
        record_key=b"rk",
        content_type="application/json",
    )
    body = encode_notice(
        "s", "k", "why", source="orders", original=original, properties={"priority": 3}
    )
    notice = decode_notice(ConsumerMessage(body))
    assert notice.record_key == b"rk"
    assert notice.properties == {
        "message_id": "m-1",
        "content_type": "application/json",
        "priority": 3,
    }
    assert notice.headers == {
        "idempotency-key": b"k",
        "x-original-topic": b"orders",
        "x-original-partition": b"1",
        "x-original-offset": b"5",
    }


# --- the loop "not executed" <-> "ends unknown again" is bounded -------------------------------


async def test_a_key_redispatched_max_redispatches_times_goes_to_the_operator(
    store: PostgresStore, scope: str
) -> None:
    runs = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal runs
        runs += 1
        raise Ambiguous("gateway timed out, every time")

    key = f"loop-{uuid.uuid4().hex[:6]}"
    transport = MemoryTransport(store)
    reconciler = Reconciler(
        store, no_charge, scopes=[scope], redispatch_grace=0, max_redispatches=3
    )
    reconciler.attach(transport)
    message = ConsumerMessage(b'{"amount": 1}', {"idempotency-key": key.encode()})
    verdicts: list[Verdict] = []
    for _ in range(10):
        delivery = await deliver(charge.process, message, transport=transport)
        assert delivery.acked
        bare = ConsumerMessage(encode_notice(scope, key, "read timeout"))  # as the sweeper sends
        verdicts.append(await reconciler.process(bare))
        if verdicts[-1].action is not Action.ACK:
            break
        sent = transport.redispatched[-1]
        assert sent.body is not None
        message = ConsumerMessage(sent.body, sent.headers)  # the copy, delivered
    assert runs == 4  # the original and 3 re-dispatches
    assert [v.reason for v in verdicts] == ["not_executed"] * 3 + ["redispatch_exhausted"]
    assert verdicts[-1].action is Action.DEAD_LETTER  # to the operator's queue
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_after is None
    assert (record.last_error or "").startswith("operator: redispatch_exhausted")
    kept = await store.redispatch.kept_original(scope, key)
    assert kept is not None and not kept.armed  # still there for the person who settles it
