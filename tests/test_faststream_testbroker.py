"""The FastStream middleware under FastStream's own test brokers, as a user's unit test runs it.

The brokers are FastStream's in-memory TestKafkaBroker / TestRabbitBroker (their fake consumer,
every Kafka record at offset 0); the store is the real Postgres. The real brokers are in
``test_faststream_real.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import asyncpg
import pytest
from faststream import AckPolicy, Context, Response
from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.rabbit import RabbitBroker, RabbitRouter, TestRabbitBroker
from pydantic import BaseModel

from consumer_idem import Ambiguous, DomainError, PostgresStore, Status, header
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotencyConfigError,
    IdempotentAttempt,
    IdempotentConnection,
)
from consumer_idem.notice import KEY_HEADER, SCOPE_HEADER
from tests._faststream import effect_count, write_effect

KEY = header("idempotency-key")
#: the delivered message itself, for the collecting subscribers
RawMessage = Annotated[Any, Context("message")]


@dataclasses.dataclass
class App:
    """One broker with an idempotent subscriber on ``in`` publishing to ``out``, and plain
    subscribers collecting ``out``, the dead letters and the notices (raw bodies and headers)."""

    broker: Any
    test_broker: Callable[[Any], Any]
    idem: Idempotency
    handler: Any
    out: list[tuple[bytes, dict[str, Any]]]
    dead: list[tuple[bytes, dict[str, Any]]]
    notices: list[tuple[bytes, dict[str, Any]]]
    publish: Callable[..., Awaitable[Any]]


def build(
    transport: str,
    store: PostgresStore,
    scope: str,
    body: Callable[..., Awaitable[Any]],
    ack_policy: AckPolicy = AckPolicy.MANUAL,
) -> App:
    if transport == "kafka":
        broker: Any = KafkaBroker()
        router: Any = KafkaRouter
        subscribe: dict[str, Any] = {"group_id": "g", "ack_policy": ack_policy}
        test_broker: Any = TestKafkaBroker
    else:
        broker = RabbitBroker()
        router = RabbitRouter
        subscribe = {"ack_policy": ack_policy}
        test_broker = TestRabbitBroker
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY, backoff=(0.01, 0.05))
    r = router(middlewares=[idem])

    @r.subscriber("in", **subscribe)
    @r.publisher("out")
    async def handler(data: Any, conn: IdempotentConnection, current: CurrentIdempotency) -> Any:
        return await body(data, conn, current)

    collected: dict[str, list[tuple[bytes, dict[str, Any]]]] = {"out": [], "dlq": [], "rec": []}

    def collector(name: str, where: str) -> None:
        @broker.subscriber(where)
        async def collect(message: RawMessage) -> None:
            collected[name].append((message.body, dict(message.headers)))

    collector("out", "out")
    collector("dlq", "in.dlq")
    collector("rec", "consumer_idem.reconcile")
    broker.include_router(r)

    async def publish(payload: Any, key: str | None = None) -> None:
        headers = {"idempotency-key": key} if key is not None else {}
        await broker.publish(payload, "in", headers=headers)

    return App(
        broker,
        test_broker,
        idem,
        handler,
        collected["out"],
        collected["dlq"],
        collected["rec"],
        publish,
    )


TRANSPORTS = ["kafka", "rabbit"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_duplicate_replays_the_stored_result_without_running_the_handler(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        await write_effect(conn, current, data["n"])
        return {"n": data["n"], "key": current.key, "at": str(await conn.fetchval("SELECT now()"))}

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 1}, "k1")  # a producer retry
        await app.publish({"n": 2}, "k2")
        await app.publish({"n": 1}, "k1")
        assert app.handler.mock.call_count == 2  # k1 once, k2 once
    assert await effect_count(pg_pool, scope) == 2
    k1 = [b for b, _ in app.out if b"k1" in b]
    assert len(k1) == 3 and len(set(k1)) == 1, k1  # the same bytes every time (now() included)
    assert len(app.out) == 4
    assert app.idem.stats.executed == 2 and app.idem.stats.duplicates == 2
    record = await store.get(scope, "k1")
    assert record is not None and record.status is Status.COMPLETED


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_input_is_dead_lettered_with_its_reason(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        await write_effect(conn, current, data["n"])
        return data["n"]

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1})  # no key
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 2}, "k1")  # the key reused for another payload
        await app.publish(b"{not json", "k3")
        await app.publish({"m": 1}, "k4")  # the handler's own KeyError: retried, never poison
    reasons = [h.get("x-dead-letter-reason") for _, h in app.dead]
    assert reasons == ["invalid_key:missing_key", "key_misuse", "invalid_json"]
    assert app.dead[1][0] == b'{"n":2}' and app.dead[1][1]["x-dead-letter-key"] == "k1"
    assert await effect_count(pg_pool, scope) == 1
    assert [b for b, _ in app.out] == [b"1"]
    failed = await store.get(scope, "k4")
    assert failed is not None and failed.status is Status.FAILED_RETRYABLE
    assert app.idem.stats.retries == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_failed_attempt_publishes_nothing_and_the_redelivery_runs_it(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    attempts: list[int] = []

    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        attempts.append(1)
        await write_effect(conn, current, data["n"])
        if len(attempts) == 1:
            raise ConnectionError("downstream hiccup")  # rolls back the insert above
        return {"attempt": len(attempts)}

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        assert app.out == []
        await app.publish({"n": 1}, "k1")  # what the broker's redelivery does
        await app.publish({"n": 1}, "k1")
    assert await effect_count(pg_pool, scope) == 1
    assert [b for b, _ in app.out] == [b'{"attempt":2}', b'{"attempt":2}']
    record = await store.get(scope, "k1")
    assert record is not None and record.attempts == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_ambiguous_failure_parks_unknown_and_publishes_one_notice(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        raise Ambiguous("gateway timed out after sending")

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 1}, "k1")  # a duplicate of a parked key: acked, not re-run
        assert app.handler.mock.call_count == 1
    assert app.out == []
    assert len(app.notices) == 1
    notice, headers = app.notices[0]
    assert headers[SCOPE_HEADER] == scope and headers[KEY_HEADER] == "k1"
    assert b'"source":"in"' in notice
    record = await store.get(scope, "k1")
    assert record is not None and record.status is Status.UNKNOWN
    assert record.reconcile_published_at is not None


class Receipt(BaseModel):
    payment_id: str
    amount: int


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "result",
    [
        Receipt(payment_id="p1", amount=5),
        b"\x00raw bytes\xff",
        "plain text",
        None,
        Response({"ok": True}, headers={"x-receipt": "r1"}),
    ],
    ids=["pydantic", "bytes", "text", "none", "response"],
)
async def test_every_kind_of_result_is_replayed_identically(
    transport: str, result: Any, store: PostgresStore, scope: str, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        return result

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 1}, "k1")
        assert app.handler.mock.call_count == 1
    (first, first_headers), (again, again_headers) = app.out
    assert first == again
    for name in ("content-type", "x-receipt"):
        assert first_headers.get(name) == again_headers.get(name)
    if isinstance(result, Response):
        assert again_headers["x-receipt"] == "r1"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_handler_returning_none_stores_sql_null_and_replays_none(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    """None is stored as the core stores it (SQL NULL, written by the claim: no UPDATE of the
    row for the result), and a duplicate publishes what the first run published."""

    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        await write_effect(conn, current, data["n"])
        return None

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 1}, "k1")
        assert app.handler.mock.call_count == 1
    record = await store.get(scope, "k1")
    assert record is not None and record.status is Status.COMPLETED
    assert record.result_json is None
    assert await effect_count(pg_pool, scope) == 1
    (first, first_headers), (again, again_headers) = app.out
    assert first == again
    assert first_headers.get("content-type") == again_headers.get("content-type")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_body_that_does_not_fit_the_handler_types_is_poison(
    transport: str, store: PostgresStore, scope: str
) -> None:
    broker: Any = KafkaBroker() if transport == "kafka" else RabbitBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY)
    router: Any = (KafkaRouter if transport == "kafka" else RabbitRouter)(middlewares=[idem])
    extra = {"group_id": "g"} if transport == "kafka" else {}
    dead: list[dict[str, Any]] = []

    @router.subscriber("in", ack_policy=AckPolicy.MANUAL, **extra)
    async def handler(receipt: Receipt) -> None:
        pass

    @broker.subscriber("in.dlq")
    async def collect(message: RawMessage) -> None:
        dead.append(dict(message.headers))

    broker.include_router(router)
    tester: Any = TestKafkaBroker if transport == "kafka" else TestRabbitBroker
    async with tester(broker):
        await broker.publish({"payment_id": "p1"}, "in", headers={"idempotency-key": "k1"})
    assert [h["x-dead-letter-reason"] for h in dead] == ["invalid_payload"]


async def test_ack_first_is_refused_before_the_handler_runs(
    store: PostgresStore, scope: str, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        raise AssertionError("must not run")

    app = build("kafka", store, scope, body, ack_policy=AckPolicy.ACK_FIRST)
    async with app.test_broker(app.broker):
        with pytest.raises(IdempotencyConfigError, match=r"AckPolicy\.MANUAL"):
            await app.publish({"n": 1}, "k1")
    assert await store.get(scope, "k1") is None


async def test_a_broker_of_another_kind_is_refused(store: PostgresStore, scope: str) -> None:
    with pytest.raises(IdempotencyConfigError, match="NatsBroker or RedisBroker"):
        Idempotency(store, broker=object(), scope=scope)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_domain_error_is_stored_acked_and_publishes_nothing(
    transport: str, store: PostgresStore, scope: str, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        raise DomainError({"declined": "insufficient_funds"})

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        await app.publish({"n": 1}, "k1")
        await app.publish({"n": 1}, "k1")
        assert app.handler.mock.call_count == 1
    assert app.out == [] and app.dead == []
    record = await store.get(scope, "k1")
    assert record is not None and record.result == {"declined": "insufficient_funds"}
    assert app.idem.stats.processed == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_phase_mode_hands_the_attempt_to_the_handler(
    transport: str, store: PostgresStore, scope: str
) -> None:
    broker: Any = KafkaBroker() if transport == "kafka" else RabbitBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY, mode="two_phase")
    router: Any = (KafkaRouter if transport == "kafka" else RabbitRouter)(middlewares=[idem])
    extra = {"group_id": "g"} if transport == "kafka" else {}
    charges: list[str] = []

    @router.subscriber("in", ack_policy=AckPolicy.MANUAL, **extra)
    @router.publisher("out")
    async def charge(data: dict[str, Any], attempt: IdempotentAttempt) -> dict[str, Any]:
        charges.append(attempt.downstream_key)  # what the gateway would dedupe on
        return {"charged": data["amount"], "attempt": attempt.number}

    out: list[bytes] = []

    @broker.subscriber("out")
    async def collect(message: RawMessage) -> None:
        out.append(message.body)

    broker.include_router(router)
    tester: Any = TestKafkaBroker if transport == "kafka" else TestRabbitBroker
    async with tester(broker):
        await broker.publish({"amount": 5}, "in", headers={"idempotency-key": "k1"})
        await broker.publish({"amount": 5}, "in", headers={"idempotency-key": "k1"})
    assert len(charges) == 1 and charges[0].startswith("ci-")
    assert out == [b'{"charged":5,"attempt":1}'] * 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_faststreams_own_ack_exceptions_map_to_verdicts(
    transport: str, store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        await write_effect(conn, current, data["n"])
        raise {"ack": AckMessage, "nack": NackMessage, "reject": RejectMessage}[current.key]()

    app = build(transport, store, scope, body)
    async with app.test_broker(app.broker):
        for key in ("ack", "nack", "reject", "ack"):
            await app.publish({"n": 1}, key)
    keys = [
        r["key"] for r in await pg_pool.fetch("SELECT key FROM fs_effects WHERE scope = $1", scope)
    ]
    assert keys == ["ack"]  # AckMessage commits what was written; the others roll back
    records = {k: await store.get(scope, k) for k in ("ack", "nack", "reject")}
    statuses = {k: r.status if r else None for k, r in records.items()}
    # a rejected message is poison: dead-lettered, its key left free for a corrected copy
    assert statuses == {"ack": Status.COMPLETED, "nack": Status.FAILED_RETRYABLE, "reject": None}
    assert [h["x-dead-letter-reason"] for _, h in app.dead] == ["rejected"]
    assert app.out == []  # AckMessage: acked without a result, as FastStream does
    assert app.idem.stats.processed == 3  # ack, the dead letter, the replay of ack


async def test_a_kafka_subscriber_running_one_partition_concurrently_is_refused(
    store: PostgresStore, scope: str, effects: None
) -> None:
    """``max_workers > 1`` on one consumer (FastStream's ConcurrentDefaultSubscriber) runs
    records of one partition side by side: committing ``offset + 1`` of a finished one would
    commit past an earlier one still running."""

    async def body(data: Any, conn: asyncpg.Connection, current: Any) -> Any:
        raise AssertionError("must not run")

    broker = KafkaBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY)
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("in", group_id="g", ack_policy=AckPolicy.ACK_FIRST, max_workers=2)
    async def handler(data: Any, conn: IdempotentConnection, current: CurrentIdempotency) -> Any:
        return await body(data, conn, current)

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        with pytest.raises(IdempotencyConfigError, match="max_workers"):
            await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k1"})
    assert await store.get(scope, "k1") is None


async def test_a_kafka_subscriber_concurrent_between_partitions_only_is_accepted(
    store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    """With manual commits FastStream runs ``max_workers`` consumers, each partition on one of
    them in order: commits stay contiguous, so the middleware accepts it."""
    broker = KafkaBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY)
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("in", group_id="g", ack_policy=AckPolicy.MANUAL, max_workers=2)
    async def handler(data: Any, conn: IdempotentConnection, current: CurrentIdempotency) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k1"})
        await broker.publish({"n": 1}, "in", headers={"idempotency-key": "k1"})
    assert await effect_count(pg_pool, scope) == 1
