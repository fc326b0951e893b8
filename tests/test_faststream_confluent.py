"""The FastStream middleware on FastStream's Confluent Kafka broker (``faststream.confluent``)
against the real Kafka and Postgres: duplicates, a retry, poison messages dead-lettered with
their reason, a Postgres outage, batch subscribers, the subscribers refused at start-up, and
consumer processes SIGKILLed mid-run."""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from faststream import AckPolicy
from faststream.confluent import KafkaBroker, KafkaRouter

from consumer_idem import PostgresStore, Status, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotencyConfigError,
    IdempotentConnection,
    _compat,
)
from tests._faststream import children as children
from tests._faststream import (
    committed,
    effect_count,
    effects_by_key,
    keyed,
    send,
    start_child,
    wait_committed,
    write_effect,
)
from tests._payments import read_topic, wait_until
from tests.conftest import unique

KEY = header("idempotency-key")
CHILD = "tests._faststream_confluent_child"
#: a quick group join and a quick notice of a dead member (the chaos test kills consumers)
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def confluent_broker(settings: Settings, **config: Any) -> KafkaBroker:
    return KafkaBroker(
        settings.kafka_bootstrap, acks="all", config={**FAST_GROUP, **config}, logger=None
    )


async def test_confluent_duplicates_run_once_and_each_commit_names_one_settled_partition(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = await kafka_topic_factory("fsc", partitions=2)
    dlq = await kafka_topic_factory("fscdlq")
    group = unique("fscg")
    commits: list[list[Any]] = []
    original = _compat.confluent_commit

    async def spy(consumer: Any, offsets: list[Any], wait: bool = True) -> None:
        commits.append(list(offsets))
        await original(consumer, offsets, wait)

    monkeypatch.setattr(_compat, "confluent_commit", spy)
    broker = confluent_broker(settings)
    idem = Idempotency(
        store, broker=broker, scope=scope, key=KEY, backoff=(0.05, 0.2), dead_letter=dlq
    )
    router = KafkaRouter(middlewares=[idem])
    failed: set[str] = set()

    @router.subscriber(
        topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])
        if current.key == "k7" and current.key not in failed:
            failed.add(current.key)  # rolled back; the partition is sought back to it
            raise ConnectionError("first attempt fails")

    broker.include_router(router)
    items = [*keyed(20, 10), (None, b'{"n": -1}')]  # the last has no key: poison
    ends = await send(kafka_producer, topic, items, 2)
    await broker.start()
    try:
        await wait_committed(kafka_admin, group, ends)
    finally:
        await broker.stop()
    assert await effect_count(pg_pool, scope) == 20
    assert idem.stats.executed == 20 and idem.stats.dead_lettered == 1
    record = await store.get(scope, "k7")
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    (dead,) = await read_topic(settings.kafka_bootstrap, dlq, 1)
    assert dict(dead.headers)["x-dead-letter-reason"] == b"invalid_key:missing_key"
    assert dict(dead.headers)["x-original-topic"] == topic.encode()
    # each commit named the one partition of the record it settled, never every position
    assert commits and all(len(c) == 1 for c in commits)
    last = {c[0].partition: c[0].offset for c in commits}
    assert last == ends


async def test_confluent_poison_is_dead_lettered_after_max_attempts_with_its_reason(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fscp")
    dlq = await kafka_topic_factory("fscdlq")
    group = unique("fscg")
    broker = confluent_broker(settings)
    idem = Idempotency(
        store,
        broker=broker,
        scope=scope,
        key=KEY,
        backoff=(0.05, 0.1),
        max_attempts=3,
        dead_letter=dlq,
    )
    router = KafkaRouter(middlewares=[idem])
    runs: list[int] = []

    @router.subscriber(
        topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    async def handle(data: dict[str, Any]) -> None:
        runs.append(data["n"])
        if data["n"] == 1:
            raise ConnectionError("the far side refuses it")

    broker.include_router(router)
    await send(kafka_producer, topic, [("poison", b'{"n": 1}'), ("next", b'{"n": 2}')], 1)
    await broker.start()
    try:
        await wait_committed(kafka_admin, group, {0: 2})
    finally:
        await broker.stop()
    assert runs == [1, 1, 1, 2]  # three attempts, then the next record (order kept)
    (dead,) = await read_topic(settings.kafka_bootstrap, dlq, 1)
    headers = dict(dead.headers)
    assert dead.value == b'{"n": 1}'
    assert headers["x-dead-letter-reason"] == b"max_attempts_exceeded"
    assert b"the far side refuses it" in headers["x-dead-letter-error"]
    assert headers["x-dead-letter-key"] == b"poison"
    assert (headers["x-original-topic"], headers["x-original-offset"]) == (topic.encode(), b"0")


async def test_confluent_postgres_outage_holds_offsets_uncommitted_then_resumes(
    settings: Settings,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    from tests._broker import Outage

    topic = await kafka_topic_factory("fsco")
    group = unique("fscg")
    outage = await Outage.start(store, pg_dsn)
    broker = confluent_broker(settings)
    idem = Idempotency(
        outage.down, broker=broker, scope=scope, key=KEY, backoff=(0.05, 0.2), max_attempts=2
    )
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber(
        topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
    )
    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        await write_effect(conn, current, data["n"])

    broker.include_router(router)
    await send(kafka_producer, topic, keyed(3), 1)
    await broker.start()
    try:

        async def waiting() -> bool:
            return idem.stats.retries >= 4

        await wait_until(waiting, 30, "the deliveries to wait for the store")
        assert idem.stats.dead_lettered == 0 and idem.stats.processed == 0
        assert await committed(kafka_admin, group) in ({}, {0: -1})  # nothing committed
        outage.end()

        await wait_committed(kafka_admin, group, {0: 3}, within=30)
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 0 and idem.stats.executed == 3
    assert await effect_count(pg_pool, scope) == 3


@pytest.mark.parametrize(
    ("options", "config", "refusal"),
    [
        ({}, {}, r"AckPolicy\.ACK_FIRST"),  # FastStream's default: it auto-commits
        ({"ack_policy": AckPolicy.ACK}, {}, r"AckPolicy\.ACK\b"),
        ({"ack_policy": AckPolicy.MANUAL}, {"enable.auto.commit": True}, r"enable\.auto\.commit"),
        # librdkafka reads booleans case-insensitively and takes "t": all but plain "off" refused
        ({"ack_policy": AckPolicy.MANUAL}, {"enable.auto.commit": "TRUE"}, r"enable\.auto\.commit"),
        ({"ack_policy": AckPolicy.MANUAL}, {"enable.auto.commit": "t"}, r"enable\.auto\.commit"),
        ({"ack_policy": AckPolicy.MANUAL}, {"enable.auto.commit": "yes"}, r"enable\.auto\.commit"),
        ({"ack_policy": AckPolicy.ACK_FIRST, "max_workers": 2}, {}, r"AckPolicy\.ACK_FIRST"),
    ],
    ids=[
        "default",
        "ack",
        "auto_commit_in_config",
        "auto_commit_upper_case",
        "auto_commit_t",
        "auto_commit_unknown_spelling",
        "concurrent",
    ],
)
async def test_confluent_subscriber_committing_before_the_middleware_is_refused_at_start(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    options: dict[str, Any],
    config: dict[str, Any],
    refusal: str,
) -> None:
    broker = confluent_broker(settings, **config)
    router = KafkaRouter(middlewares=[Idempotency(store, broker=broker, scope=scope)])

    @router.subscriber(unique("fscr"), group_id=unique("fscg"), **options)
    async def handle(data: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    broker.include_router(router)
    with pytest.raises(IdempotencyConfigError, match=refusal):
        await broker.start()
    await broker.stop()


async def test_confluent_batch_subscriber_runs_each_key_once_and_dead_letters_its_poison(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fscb", partitions=2)
    dlq = await kafka_topic_factory("fscdlq")
    group = unique("fscg")
    broker = confluent_broker(settings)
    idem = Idempotency(
        store, broker=broker, scope=scope, key=KEY, backoff=(0.05, 0.2), dead_letter=dlq
    )
    router = KafkaRouter(middlewares=[idem])
    failed: set[str] = set()
    sizes: list[int] = []

    @router.subscriber(
        topic,
        group_id=group,
        batch=True,
        max_records=8,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
    )
    async def handle(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> None:
        sizes.append(len(bodies))
        if "k13" in current.keys and "k13" not in failed:
            failed.add("k13")  # the batch rolls back; its members run one by one
            raise ConnectionError("the batch fails once")
        await conn.executemany(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
            [(scope, key, body["n"]) for key, body in zip(current.keys, bodies, strict=True)],
        )

    broker.include_router(router)
    items = keyed(40, 15)
    items.insert(21, (None, b'{"n": -1}'))  # no key: dead-lettered, never handed over
    ends = await send(kafka_producer, topic, items, 2)
    await broker.start()
    try:
        await wait_committed(kafka_admin, group, ends)
    finally:
        await broker.stop()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(40)})
    assert max(sizes) > 1  # batches, not one record at a time
    assert failed == {"k13"}
    (dead,) = await read_topic(settings.kafka_bootstrap, dlq, 1)
    assert dict(dead.headers)["x-dead-letter-reason"] == b"invalid_key:missing_key"
    assert idem.stats.dead_lettered == 1


# --- SIGKILL chaos -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
async def test_confluent_consumer_sigkilled_mid_run_loses_and_doubles_nothing(
    batch: bool,
    pg_dsn: str,
    store: PostgresStore,  # migrated
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
    children: list[asyncio.subprocess.Process],
) -> None:
    total = 300
    kind = "batch" if batch else "single"
    topic = await kafka_topic_factory("fsck", partitions=2)
    group = unique("fsckg")
    ends = await send(kafka_producer, topic, keyed(total, 40), 2)
    rng = random.Random(scope)
    for kill in range(4):
        # twice killed by itself inside a handler call, held past an auto-commit; twice
        # killed from outside, wherever it is (handler, Postgres commit, Kafka commit)
        inside = kill % 2 == 0
        kill_at = (rng.randint(1, 2) if batch else rng.randint(10, 40)) if inside else 0
        proc = await start_child(CHILD, pg_dsn, topic, group, scope, kind, str(kill_at))
        if not inside:
            # at most half way: what the child settles between the last poll and the kill
            # (a batch consumer takes tens of records in a poll's 0.1 s) must leave work
            # unsettled for the kill to land on
            so_far = (await effects_by_key(pg_pool, scope)).total()
            target = min(so_far + rng.randint(20, 50), total // 2)

            async def under_way(target: int = target) -> bool:
                return (await effects_by_key(pg_pool, scope)).total() >= target

            await wait_until(under_way, 30, "the child to be under way")
            proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), timeout=30)
        assert proc.returncode == -signal.SIGKILL
    done = (await effects_by_key(pg_pool, scope)).total()
    assert 0 < done < total, f"the kills must land mid-run ({done})"
    final = await start_child(CHILD, pg_dsn, topic, group, scope, kind, "0")
    try:
        await wait_committed(kafka_admin, group, ends)
    finally:
        final.send_signal(signal.SIGTERM)
        await asyncio.wait_for(final.communicate(), timeout=30)
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(total)})


@pytest.mark.parametrize("value", [False, 0, "false", "FALSE", "f", "F", "0"])
def test_confluent_auto_commit_spelled_off_is_accepted(value: object) -> None:
    from consumer_idem.faststream.confluent_side import plainly_off

    assert plainly_off(value)
