"""The FastStream middleware on a real NATS server with JetStream: duplicates, poison after
``max_deliveries``, a Postgres outage, and the subscribers refused at start-up."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from uuid import uuid4

import asyncpg
import nats
import pytest
from faststream import AckPolicy
from faststream.nats import ConsumerConfig, JStream, NatsBroker, NatsRouter
from nats.aio.msg import Msg
from nats.js import api

from consumer_idem import Ambiguous, IdempotencyConfigError, PostgresStore, Status
from consumer_idem.faststream import (
    CurrentIdempotency,
    Idempotency,
    IdempotentConnection,
    IdempotentOutbox,
)
from tests._faststream import effect_count, write_effect
from tests._outbox import outbox_store, rows, sent_keys
from tests._payments import wait_until
from tests.conftest import unique


@pytest.fixture
async def subject(nats_url: str) -> AsyncIterator[str]:
    """A subject of its own, in a stream of its own (with its ``.dlq`` and ``.out`` subjects),
    deleted after."""
    name = unique("fsn")
    yield name
    client = await nats.connect(nats_url)
    try:
        await client.jsm().delete_stream(name)
    except Exception:  # never created (a test refused before the broker declared it)
        pass
    finally:
        await client.close()


def stream_of(subject: str) -> JStream:
    return JStream(subject, subjects=[subject, f"{subject}.dlq", f"{subject}.out"])


async def pending(nats_url: str, subject: str) -> tuple[int, int]:
    """(messages not yet delivered, deliveries not yet acked) of the test's durable consumer."""
    client = await nats.connect(nats_url)
    try:
        info = await client.jsm().consumer_info(subject, "worker")
        return info.num_pending, info.num_ack_pending
    finally:
        await client.close()


async def test_nats_duplicates_run_once_and_nats_msg_id_is_the_key(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
) -> None:
    broker = NatsBroker(nats_url)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.5))
    router = NatsRouter(middlewares=[idem])

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await broker.start()
    try:
        # the same key twice under other dedup ids (JetStream's own window lets both in)
        for n in range(10):
            for copy in range(2):
                await broker.publish(
                    {"n": n},
                    subject,
                    headers={"idempotency-key": f"k{n}", "Nats-Msg-Id": f"m{n}-{copy}"},
                    stream=subject,
                )
        await broker.publish({"n": 99}, subject, headers={"Nats-Msg-Id": "only-id"}, stream=subject)

        async def all_settled() -> bool:
            return idem.stats.processed >= 21

        await wait_until(all_settled, 30, "every delivery to be settled")
    finally:
        await broker.stop()
    assert await effect_count(pg_pool, scope) == 11
    assert idem.stats.executed == 11 and idem.stats.dead_lettered == 0
    assert await store.get(scope, "only-id") is not None  # keyed by the publisher's dedup id
    assert await pending(nats_url, subject) == (0, 0)  # every delivery acked


async def test_nats_poison_is_dead_lettered_after_max_deliveries_with_its_reason(
    nats_url: str, store: PostgresStore, scope: str, effects: None, subject: str
) -> None:
    broker = NatsBroker(nats_url)
    idem = Idempotency(
        store, broker=broker, scope=scope, backoff=(0.05, 0.1), max_attempts=50, max_deliveries=3
    )
    router = NatsRouter(middlewares=[idem])
    runs: list[int] = []

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(data: dict[str, Any]) -> None:
        runs.append(data["n"])
        raise ConnectionError("the far side refuses it")

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "poison"}, stream=subject)

        async def dead_lettered() -> bool:
            return idem.stats.dead_lettered >= 1

        await wait_until(dead_lettered, 30, "the poison message to be dead-lettered")
    finally:
        await broker.stop()
    assert runs == [1, 1, 1]  # one run per JetStream delivery, none after the third
    client = await nats.connect(nats_url)
    try:
        dead = await client.jsm().get_last_msg(subject, f"{subject}.dlq")
    finally:
        await client.close()
    assert dead.data == b'{"n":1}' or dead.data == b'{"n": 1}'
    assert dead.headers is not None
    assert dead.headers["x-dead-letter-reason"] == "max_deliveries_exceeded"
    assert "the far side refuses it" in dead.headers["x-dead-letter-error"]
    assert dead.headers["x-dead-letter-deliveries"] == "3"
    assert dead.headers["x-dead-letter-key"] == "poison"
    assert dead.headers["x-original-queue"] == subject
    assert await pending(nats_url, subject) == (0, 0)  # the original acked after the copy


async def test_nats_postgres_outage_holds_messages_unacked_then_resumes_with_its_budget(
    nats_url: str,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
) -> None:
    from tests._broker import Outage

    outage = await Outage.start(store, pg_dsn)
    broker = NatsBroker(nats_url)
    idem = Idempotency(
        outage.down, broker=broker, scope=scope, backoff=(0.05, 0.2), max_deliveries=2
    )
    router = NatsRouter(middlewares=[idem])
    runs: list[int] = []

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(data["n"])
        await write_effect(conn, current, data["n"])
        if len(runs) == 1:  # the first run after the outage: the waits spent none of its budget
            raise ConnectionError("first attempt fails")

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "k1"}, stream=subject)
        await asyncio.sleep(3)  # many more deliveries than max_deliveries=2 meanwhile
        assert idem.stats.retries >= 4 and idem.stats.dead_lettered == 0
        assert await pending(nats_url, subject) == (0, 1)  # delivered, unacked
        outage.end()

        async def ran() -> bool:
            return idem.stats.processed >= 1

        await wait_until(ran, 15, "the message to run once the store is back")
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 0 and idem.stats.executed == 1
    assert runs == [1, 1]
    assert await effect_count(pg_pool, scope) == 1
    assert await pending(nats_url, subject) == (0, 0)


async def test_nats_core_subscriber_is_refused_at_start(
    nats_url: str, store: PostgresStore, scope: str
) -> None:
    broker = NatsBroker(nats_url)
    router = NatsRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(unique("core"), ack_policy=AckPolicy.MANUAL)
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match="core NATS subscriber"):
        await broker.start()
    await broker.stop()


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({}, r"AckPolicy\.REJECT_ON_ERROR"),  # FastStream's default: it would settle too
        ({"ack_policy": AckPolicy.ACK_FIRST}, r"acks each message as it arrives"),
        (
            {
                "ack_policy": AckPolicy.MANUAL,
                "config": ConsumerConfig(ack_policy=api.AckPolicy.ALL),
            },
            r"ack_policy=AckPolicy\.ALL",
        ),
        (
            {"ack_policy": AckPolicy.MANUAL, "config": ConsumerConfig(max_deliver=5)},
            r"max_deliver=5",
        ),
        (
            {"ack_policy": AckPolicy.MANUAL, "ordered_consumer": True},
            r"ordered JetStream consumer",
        ),
    ],
    ids=["default", "ack_first", "ack_all", "max_deliver_under_budget", "ordered_consumer"],
)
async def test_nats_subscriber_settling_before_the_middleware_is_refused_at_start(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    subject: str,
    options: dict[str, Any],
    refusal: str,
) -> None:
    broker = NatsBroker(nats_url)
    router = NatsRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(subject, stream=stream_of(subject), durable="worker", **options)
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=refusal):
        await broker.start()
    await broker.stop()


@pytest.mark.parametrize(
    ("server_config", "refusal"),
    [
        ({"max_deliver": 2}, r"already exists on the server.*max_deliver=2"),
        ({"ack_policy": api.AckPolicy.ALL}, r"already exists on the server.*ack_policy=all"),
    ],
    ids=["max_deliver_under_budget", "ack_all"],
)
async def test_nats_durable_consumer_on_the_server_losing_messages_is_refused_at_start(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    subject: str,
    server_config: dict[str, Any],
    refusal: str,
) -> None:
    # an earlier deploy (or an operator's edit) left the durable consumer with other
    # settings: nats-py binds to it as it is, whatever the subscriber's own config says
    broker = NatsBroker(nats_url)
    idem = Idempotency(store, broker=broker, scope=scope, max_deliveries=4)
    router = NatsRouter(middlewares=[idem])
    runs: list[int] = []

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(data: dict[str, Any]) -> None:
        runs.append(data["n"])

    broker.include_router(router)
    client = await nats.connect(nats_url)
    try:
        jetstream = client.jetstream()
        await jetstream.add_stream(name=subject, subjects=list(stream_of(subject).subjects))
        await jetstream.add_consumer(
            subject,
            api.ConsumerConfig(
                durable_name="worker", deliver_subject=unique("deliver"), **server_config
            ),
        )
        await jetstream.publish(subject, b'{"n": 1}')
        with pytest.raises(IdempotencyConfigError, match=refusal):
            await broker.start()
        await broker.stop()
    finally:
        await client.close()
    assert runs == []  # refused before anything was fetched


async def test_nats_subscriber_added_after_start_is_refused_before_it_consumes(
    nats_url: str, store: PostgresStore, scope: str
) -> None:
    broker = NatsBroker(nats_url)
    router = NatsRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])
    broker.include_router(router)
    await broker.start()
    try:
        # a runtime subscriber: core NATS, nothing redelivers what it loses
        late = router.subscriber(unique("core"), ack_policy=AckPolicy.MANUAL)

        @late
        async def handle(data: dict[str, Any]) -> None:
            raise AssertionError("never runs")

        with pytest.raises(IdempotencyConfigError, match="core NATS subscriber"):
            await late.start()
        assert late.subscription is None  # never subscribed
    finally:
        await broker.stop()


async def test_nats_outbox_publishes_through_jetstream_once_per_committed_run(
    nats_url: str, store: PostgresStore, pg_pool: asyncpg.Pool, scope: str, subject: str
) -> None:
    outbox = outbox_store(pg_pool, relay_after=60)
    broker = NatsBroker(nats_url)
    idem = Idempotency(outbox, broker=broker, scope=scope, backoff=(0.05, 0.2))
    router = NatsRouter(middlewares=[idem])
    failed: set[str] = set()

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def book(
        data: dict[str, Any], outbox: IdempotentOutbox, current: CurrentIdempotency
    ) -> None:
        outbox.publish(f"{subject}.out", {"booked": data["n"]})
        if data.get("fail_once") and current.key not in failed:
            failed.add(current.key)  # rolled back with its message; the redelivery publishes
            raise ConnectionError("first attempt fails")

    broker.include_router(router)
    await broker.start()
    try:
        for n, msg_id, fail in ((1, "m1", False), (2, "m2", True), (1, "m1", False)):
            # m1 twice under other dedup ids: JetStream's own window lets both in
            await broker.publish(
                {"n": n, "fail_once": fail},
                subject,
                headers={"idempotency-key": msg_id, "Nats-Msg-Id": f"{msg_id}-{uuid4()}"},
                stream=subject,
            )

        async def sent() -> bool:
            found = await rows(outbox, scope)
            return idem.stats.processed >= 3 and {r["status"] for r in found} == {"sent"}

        await wait_until(sent, 30, "every delivery settled and the outbox dispatched")
    finally:
        await broker.stop()
    client = await nats.connect(nats_url)
    try:
        reader = await client.jetstream().pull_subscribe(f"{subject}.out", stream=subject)
        messages = await reader.fetch(3, timeout=2)
    finally:
        await client.close()
    assert sorted(json.loads(m.data)["booked"] for m in messages) == [1, 2]
    keys = await sent_keys(outbox, scope)
    assert {m.headers["idempotency-key"] for m in messages if m.headers} == {
        keys[k] for k in ("m1", "m2")
    }


async def test_nats_dead_letter_no_stream_takes_leaves_the_delivery_unacked(
    nats_url: str, store: PostgresStore, scope: str, subject: str
) -> None:
    broker = NatsBroker(nats_url)
    idem = Idempotency(
        store,
        broker=broker,
        scope=scope,
        backoff=(0.05, 0.1),
        max_deliveries=1,
        dead_letter=unique("nowhere"),  # no stream takes it
    )
    router = NatsRouter(middlewares=[idem])

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(data: dict[str, Any]) -> None:
        raise ConnectionError("the far side refuses it")

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "poison"}, stream=subject)
        await asyncio.sleep(3)  # the dead letter refused, retried: held in hand meanwhile
        assert idem.stats.dead_lettered == 0 and idem.stats.processed == 0
        assert await pending(nats_url, subject) == (0, 1)  # in hand, never acked
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 0


async def test_nats_retry_is_a_nak_with_the_backoff_delay_the_server_keeps_it_for(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    naks: list[float | None] = []
    original_nak = Msg.nak

    async def spy(self: Msg, delay: float | None = None) -> None:
        naks.append(delay)
        await original_nak(self, delay=delay)

    monkeypatch.setattr(Msg, "nak", spy)
    broker = NatsBroker(nats_url)
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(1.0, 1.0))
    router = NatsRouter(middlewares=[idem])
    runs: list[float] = []

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        runs.append(time.monotonic())
        await write_effect(conn, current, data["n"])
        if len(runs) == 1:
            raise ConnectionError("first attempt fails")  # rolled back, retried

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "k1"}, stream=subject)

        async def ran_twice() -> bool:
            return idem.stats.processed >= 1

        await wait_until(ran_twice, 15, "the retry to run")
    finally:
        await broker.stop()
    assert len(naks) == 1 and naks[0] is not None and 0 < naks[0] <= 1.0  # the jittered backoff
    assert runs[1] - runs[0] >= naks[0] * 0.9  # kept on the server that long, not in hand
    assert await effect_count(pg_pool, scope) == 1
    assert await pending(nats_url, subject) == (0, 0)


@pytest.mark.parametrize("notices_stored", [True, False], ids=["stored", "no_stream"])
async def test_nats_unknown_outcome_notice_is_confirmed_by_jetstream_before_the_ack(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    effects: None,
    subject: str,
    notices_stored: bool,
) -> None:
    notices = f"{subject}.out" if notices_stored else unique("nowhere")  # no stream takes it
    broker = NatsBroker(nats_url)
    idem = Idempotency(
        store, broker=broker, scope=scope, backoff=(0.05, 0.2), reconcile_destination=notices
    )
    router = NatsRouter(middlewares=[idem])

    @router.subscriber(
        subject, stream=stream_of(subject), durable="worker", ack_policy=AckPolicy.MANUAL
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])
        raise Ambiguous("the far side timed out")

    broker.include_router(router)
    await broker.start()
    try:
        await broker.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "k1"}, stream=subject)

        async def parked() -> bool:
            record = await store.get(scope, "k1")
            return record is not None and record.status is Status.UNKNOWN

        await wait_until(parked, 15, "the outcome to be parked unknown")
        if notices_stored:

            async def settled() -> bool:
                return idem.stats.processed >= 1

            await wait_until(settled, 15, "the delivery to be settled")
        else:
            await asyncio.sleep(2)  # the notice refused, retried: held in hand meanwhile
    finally:
        await broker.stop()
    record = await store.get(scope, "k1")
    assert record is not None and record.status is Status.UNKNOWN
    if not notices_stored:
        assert record.reconcile_published_at is None
        assert await pending(nats_url, subject) == (0, 1)  # in hand, never acked
        return
    assert record.reconcile_published_at is not None
    assert await pending(nats_url, subject) == (0, 0)
    client = await nats.connect(nats_url)
    try:
        notice = await client.jsm().get_last_msg(subject, notices)
    finally:
        await client.close()
    assert notice.headers is not None
    assert notice.headers["x-consumer-idem-key"] == "k1"
    assert notice.headers["x-consumer-idem-scope"] == scope
