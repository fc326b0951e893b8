"""The outbox from the other entry points: an HTTP route (``outbox_of(request)``) and a
FastStream subscriber (``IdempotentOutbox``), on real Postgres and Kafka."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaProducer
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker, KafkaRouter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import (
    IdempotencyConfigError,
    OutcomeKind,
    PostgresStore,
    header,
    run_transactional,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import CurrentIdempotency, Idempotency, IdempotentOutbox
from consumer_idem.http import IdempotencyMiddleware, outbox_of
from consumer_idem.outbox import OutboxService, outbox_for
from consumer_idem.transports.kafka import KafkaOutboxSender
from tests._outbox import header as header_of
from tests._outbox import outbox_store, producer, rows, sent_keys
from tests._payments import read_topic, wait_until
from tests.conftest import unique


@pytest.fixture(autouse=True)
async def _migrated(store: PostgresStore) -> None:
    """Every test here runs on the session's migrated schema (through a store of its own)."""


async def test_an_http_route_publishes_once_per_committed_request(
    settings: Settings, pg_pool: asyncpg.Pool, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool, relay_after=60)
    topic = await kafka_topic_factory("outbox-http")
    tenant = unique("tenant")

    async def create(request: Request) -> JSONResponse:
        data = await request.json()
        outbox_of(request).publish(topic, {"order": data["order"]}, key=data["order"])
        if data.get("fail"):  # a 5xx is not committed: its message must not leave
            return JSONResponse({"error": "upstream"}, status_code=502)
        return JSONResponse({"order": data["order"]}, status_code=201)

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, caller=lambda conn: tenant)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        first = await client.post("/orders", json={"order": "o1"}, headers={"Idempotency-Key": "a"})
        again = await client.post("/orders", json={"order": "o1"}, headers={"Idempotency-Key": "a"})
        failed = await client.post(
            "/orders", json={"order": "o2", "fail": True}, headers={"Idempotency-Key": "b"}
        )
        assert (first.status_code, again.status_code, failed.status_code) == (201, 201, 502)
        assert again.headers.get("idempotent-replayed") == "true"
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
    records = await read_topic(settings.kafka_bootstrap, topic, 2, within=5)
    assert [json.loads(r.value) for r in records] == [{"order": "o1"}]
    # the unit is the request's record: its scope names the caller and the route
    (row,) = await pg_pool.fetch(
        f"SELECT scope, status FROM {store.outbox.table} WHERE scope LIKE $1", f"http:{tenant}:%"
    )
    assert row["status"] == "sent"
    assert header_of(records[0]) == (await sent_keys(store, row["scope"]))["a"]


async def test_a_faststream_subscriber_publishes_through_its_broker_once(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
) -> None:
    store = outbox_store(pg_pool, relay_after=60)
    source = await kafka_topic_factory("outbox-fs-in")
    events = await kafka_topic_factory("outbox-fs-out")
    broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    idem = Idempotency(store, broker=broker, scope=scope, key=header("idempotency-key"))
    router = KafkaRouter(middlewares=[idem])
    failed: set[str] = set()

    @router.subscriber(
        source, group_id=unique("fsg"), ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    async def book(
        data: dict[str, Any], outbox: IdempotentOutbox, current: CurrentIdempotency
    ) -> None:
        outbox.publish(events, {"booked": data["n"]}, key=current.key)
        if data.get("fail_once") and current.key not in failed:
            failed.add(current.key)  # rolled back with its message; the redelivery publishes
            raise ConnectionError("first attempt fails")

    broker.include_router(router)
    items = [("k1", {"n": 1}), ("k2", {"n": 2, "fail_once": True}), ("k1", {"n": 1})]
    for key, body in items:
        await kafka_producer.send_and_wait(
            source, json.dumps(body).encode(), headers=[("idempotency-key", key.encode())]
        )
    await broker.start()
    try:

        async def settled() -> bool:
            return idem.stats.processed >= len(items)

        await wait_until(settled, 60, "every record to be settled")

        async def sent() -> bool:
            return {r["status"] for r in await rows(store, scope)} == {"sent"}

        await wait_until(sent, 30, "the outbox to be dispatched")
    finally:
        await broker.stop()
    records = await read_topic(settings.kafka_bootstrap, events, 3, within=5)
    assert sorted(json.loads(r.value)["booked"] for r in records) == [1, 2]
    keys = await sent_keys(store, scope)
    assert {header_of(r) for r in records} == {keys[k] for k in ("k1", "k2")}


async def test_a_sqlalchemy_session_publishes_through_its_units_outbox(
    settings: Settings, pg_dsn: str, scope: str, kafka_topic_factory: Any
) -> None:
    """The store on the application's engine (one pool): ``outbox_for(connection_of(session))``
    reaches the unit's outbox; a session that rolls back rolls its messages back with it."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from consumer_idem import OutcomeKind, run_transactional
    from consumer_idem.outbox import outbox_for
    from consumer_idem.sqlalchemy import connection_of, engine_store, with_session

    engine = create_async_engine(make_url(pg_dsn).set(drivername="postgresql+asyncpg"))
    store = engine_store(engine)
    store.outbox.relay_after = 60
    topic = await kafka_topic_factory("outbox-sa")

    def booking(n: int, roll_back: bool = False) -> Any:
        async def book(session: AsyncSession) -> int:
            await session.execute(text("SELECT 1"))
            outbox_for(connection_of(session)).publish(topic, {"n": n})
            if roll_back:
                await session.rollback()  # the whole unit, its message too
            return n

        return with_session(book)

    try:
        async with (
            producer(settings.kafka_bootstrap) as p,
            OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
        ):
            kinds = [
                (await run_transactional(store, scope, key, "v1:x", booking(n, rb))).kind
                for key, n, rb in (("a", 1, False), ("a", 1, False), ("b", 2, True))
            ]
            assert kinds == [
                OutcomeKind.EXECUTED,
                OutcomeKind.REPLAYED,
                OutcomeKind.FAILED_RETRYABLE,
            ]
            assert service.dispatcher is not None and await service.dispatcher.drain(10)
        assert [r["status"] for r in await rows(store, scope)] == ["sent"]
    finally:
        await engine.dispose()
    records = await read_topic(settings.kafka_bootstrap, topic, 2, within=5)
    assert [json.loads(r.value) for r in records] == [{"n": 1}]
    assert header_of(records[0]) == (await sent_keys(store, scope))["a"]


async def test_a_faststream_app_relays_what_a_crash_left_with_no_new_message(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    """A unit committed in a process that died before its dispatch: the app's relay starts with
    the app (no delivery needed) and sends it; it stops when the app stops."""
    store = outbox_store(pg_pool)  # due for a relay at once
    source = await kafka_topic_factory("outbox-fs-idle")
    events = await kafka_topic_factory("outbox-fs-left")

    async def book(conn: asyncpg.Connection) -> str:
        outbox_for(conn).publish(events, {"order": "o1"})
        return "booked"

    # no sender attached: as if its process had died right after the COMMIT
    assert (await run_transactional(store, scope, "o1", "v1:x", book)).kind is (
        OutcomeKind.EXECUTED
    )
    broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    app = FastStream(broker)
    idem = Idempotency(
        store, broker=broker, scope=scope, key=header("idempotency-key"), app=app, outbox_relay=0.2
    )
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber(source, group_id=unique("fsg"), ack_policy=AckPolicy.MANUAL)
    async def handle(data: dict[str, Any]) -> None:  # never gets a message here
        raise AssertionError(data)

    broker.include_router(router)
    await app.start()
    try:

        async def sent() -> bool:
            return [r["status"] for r in await rows(store, scope)] == ["sent"]

        await wait_until(sent, 20, "the app's relay to send the message left behind")
        assert idem.outbox_relay.running
    finally:
        await app.stop()
    assert not idem.outbox_relay.running
    records = await read_topic(settings.kafka_bootstrap, events, 1)
    assert [json.loads(r.value) for r in records] == [{"order": "o1"}]


def test_a_faststream_relay_refuses_what_is_not_an_app(pg_pool: asyncpg.Pool, scope: str) -> None:
    broker = KafkaBroker("127.0.0.1:9092")
    with pytest.raises(IdempotencyConfigError, match="FastStream application"):
        Idempotency(PostgresStore(pg_pool), broker=broker, scope=scope, app=object())
    with pytest.raises(IdempotencyConfigError, match="outbox_relay"):
        Idempotency(PostgresStore(pg_pool), broker=broker, scope=scope, outbox_relay=0)


class _Unsent:
    """A sender of another process, for the route it states: it sends nothing (the rows stay
    pending, as a crash leaves them)."""

    def __init__(self, route: str) -> None:
        self.route = route

    def permanent(self, exc: BaseException) -> bool:
        return False

    async def send_batch(self, messages: Any) -> list[BaseException | None]:
        return [ConnectionError("not sent")] * len(messages)


async def test_a_faststream_apps_relay_sends_its_own_clusters_rows_only(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    """A FastStream app's route names its broker's cluster, as a runner's does: it relays a
    message left by a runner of its scope on its cluster (the bootstrap list spelled in another
    order), never one left for another cluster by an app of the same scope there."""
    store = outbox_store(pg_pool)  # due for a relay at once
    source = await kafka_topic_factory("outbox-fs-cluster")
    events = await kafka_topic_factory("outbox-fs-cluster-out")
    servers = [s.strip() for s in settings.kafka_bootstrap.split(",")]
    here = "kafka:" + ",".join(sorted(servers))
    elsewhere = "kafka:kafka.other-dc:9092"

    for key, route in (("here", here), ("elsewhere", elsewhere)):

        async def book(conn: asyncpg.Connection, key: str = key) -> str:
            outbox_for(conn).publish(events, {"order": key})
            return "booked"

        async with OutboxService(
            store, _Unsent(route), relay_interval=None, dispatch={"max_queued": 0}
        ):
            outcome = await run_transactional(store, scope, key, "v1:x", book)
            assert outcome.kind is OutcomeKind.EXECUTED

    broker = KafkaBroker(list(reversed(servers)), acks="all", enable_idempotence=True)
    app = FastStream(broker)
    idem = Idempotency(
        store, broker=broker, scope=scope, key=header("idempotency-key"), app=app, outbox_relay=0.2
    )
    assert idem.route == here
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber(source, group_id=unique("fsg"), ack_policy=AckPolicy.MANUAL)
    async def handle(data: dict[str, Any]) -> None:  # never gets a message here
        raise AssertionError(data)

    broker.include_router(router)
    await app.start()
    try:

        async def sent() -> bool:
            return {r["unit_key"]: r["status"] for r in await rows(store, scope)}["here"] == "sent"

        await wait_until(sent, 20, "the app's relay to send its cluster's message")
        await asyncio.sleep(1.0)  # a few more passes of the relay
    finally:
        await app.stop()
    statuses = {r["unit_key"]: r["status"] for r in await rows(store, scope)}
    assert statuses == {"here": "sent", "elsewhere": "pending"}
    records = await read_topic(settings.kafka_bootstrap, events, 2, within=5)
    assert [json.loads(r.value) for r in records] == [{"order": "here"}]


def test_a_faststream_rabbit_apps_route_is_its_runners_without_credentials(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str
) -> None:
    """A RabbitMQ app's route names its broker and vhost as a runner's sender does, so either
    one relays what the other left on the same broker; the credentials are never stored."""
    from faststream.rabbit import RabbitBroker

    from consumer_idem.transports.rabbit import RabbitOutboxSender

    url = "amqp://guest:s3cret@127.0.0.1:5672/orders%2Feu"
    idem = Idempotency(PostgresStore(pg_pool), broker=RabbitBroker(url), scope=scope)
    assert idem.route == RabbitOutboxSender(lambda: None, broker=url).route
    assert idem.route == "amqp:127.0.0.1:5672/orders/eu" and "s3cret" not in idem.route
