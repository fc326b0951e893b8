"""FastStream Kafka batch subscribers (``batch=True``) through the middleware, on the real
broker and database: duplicates within and across batches, poison members, a failing member,
an ambiguous one, the store's connections terminated mid-run, a rebalance between two
consumers, and consumer processes SIGKILLed mid-batch."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections import Counter
from typing import Annotated, Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faststream import AckPolicy, BaseMiddleware, Context, ExceptionMiddleware
from faststream.exceptions import RejectMessage
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage

from consumer_idem import Ambiguous, PostgresStore, Status, StoreUnavailable, header
from consumer_idem.cli.settings import Settings
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotencyConfigError,
    IdempotentConnection,
)
from consumer_idem.notice import decode_notice
from consumer_idem.transports.kafka import to_message
from tests._faststream import children as children
from tests._faststream import committed, effects_by_key, keyed, send
from tests._faststream import start_child as start_process
from tests._payments import read_topic, wait_until
from tests.conftest import unique

KEY = header("idempotency-key")


def idempotent_broker(
    settings: Settings, store: PostgresStore, scope: str, **options: Any
) -> tuple[KafkaBroker, Idempotency]:
    """A broker that publishes durably, and the middleware on ``store`` keyed by ``KEY``."""
    broker = KafkaBroker(settings.kafka_bootstrap, acks="all", enable_idempotence=True)
    return broker, Idempotency(store, broker=broker, scope=scope, key=KEY, **options)


async def run_until_committed(
    broker: KafkaBroker,
    admin: AIOKafkaAdminClient,
    group: str,
    offsets: dict[int, int],
    within: float,
) -> None:
    """Run the broker until the group's committed offsets are ``offsets``, then stop it."""
    await broker.start()
    try:

        async def settled() -> bool:
            return await committed(admin, group) == offsets

        await wait_until(settled, within, f"the group to commit {offsets}")
    finally:
        await broker.stop()


def batch_app(
    broker: KafkaBroker,
    idem: Idempotency,
    topic: str,
    group: str,
    sizes: list[int],
    failed: Counter[str],
    max_records: int = 8,
    slow: float = 0.0,
    announce: str | None = None,
) -> None:
    """A batch subscriber writing one effect row per body on the transaction's connection (and
    publishing one message per body to ``announce`` through the member's outbox)."""
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber(
        topic,
        group_id=group,
        batch=True,
        max_records=max_records,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
    )
    async def handle(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> list[dict[str, Any]]:
        assert len(bodies) == len(current.keys) == len(current.messages)
        sizes.append(len(bodies))
        results = []
        for i, (body, key) in enumerate(zip(bodies, current.keys, strict=True)):
            if announce is not None:
                current.outboxes[i].publish(announce, {"key": key})
            await conn.execute(
                "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
                current.scope,
                key,
                body["n"],
            )
            if body.get("reject"):
                raise RejectMessage()
            if body.get("ambiguous"):
                raise Ambiguous("the far side timed out")
            if body.get("fail_twice") and failed[key] < 2:
                # the batch's attempt (rolled back, not counted), then its own: retried
                failed[key] += 1
                raise ConnectionError("first attempts fail")
            results.append({"key": key, "n": body["n"]})
        await asyncio.sleep(slow)  # a window for the faults to land mid-transaction
        return results

    broker.include_router(router)


async def test_duplicates_poison_a_retry_and_an_unknown_in_batches_commit_each_partition(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fsb", partitions=2)
    notices = await kafka_topic_factory("fsbrec")
    announced = await kafka_topic_factory("fsbout")
    await kafka_admin.create_topics([NewTopic(f"{topic}.dlq", 1, 1)])
    group = unique("fsbg")
    items: list[tuple[str | None, bytes]] = [
        (f"k{i}", json.dumps({"n": i, "fail_twice": i == 7}).encode()) for i in range(40)
    ]
    # duplicates right after their originals (same batch) and far from them (other batches)
    items[5:5] = [items[3]]
    items += items[:12]
    items += [
        (None, b'{"n": -1}'),  # no key
        ("bad", b"not json"),
        ("rej", b'{"n": -2, "reject": true}'),
        ("amb", b'{"n": -3, "ambiguous": true}'),
    ]
    await send(kafka_producer, topic, items, 2)

    broker, idem = idempotent_broker(
        settings, store, scope, backoff=(0.05, 0.5), reconcile_destination=notices
    )
    sizes: list[int] = []
    failed: Counter[str] = Counter()
    batch_app(broker, idem, topic, group, sizes, failed, announce=announced)
    await broker.start()
    try:

        async def all_settled() -> bool:
            return idem.stats.processed >= len(items)

        await wait_until(all_settled, 60, "every record to be settled")
        await asyncio.sleep(0.5)  # a record handled twice would show now
    finally:
        await broker.stop()

    # every key's effect once (the rejected and the ambiguous members' effects rolled back)
    counts = await effects_by_key(pg_pool, scope)
    assert counts == Counter({f"k{i}": 1 for i in range(40)}), counts
    assert max(sizes) > 1, "the handler must get batches"
    # each member's outbox message went out once, after its commit (none of a rolled-back try)
    out = await read_topic(settings.kafka_bootstrap, announced, 41, within=4)
    assert sorted(json.loads(r.value)["key"] for r in out) == sorted(f"k{i}" for i in range(40))
    assert failed == {"k7": 2}
    record = await store.get(scope, "k7")
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    record = await store.get(scope, "k12")
    assert record is not None and record.result == {"body": {"key": "k12", "n": 12}}
    amb = await store.get(scope, "amb")
    assert amb is not None and amb.status is Status.UNKNOWN
    assert amb.reconcile_published_at is not None
    (notice,) = await read_topic(settings.kafka_bootstrap, notices, 1)
    assert decode_notice(to_message(notice)).key == "amb"
    dead = await read_topic(settings.kafka_bootstrap, f"{topic}.dlq", 3)
    reasons = sorted(dict(r.headers)["x-dead-letter-reason"] for r in dead)
    assert reasons == [b"invalid_json", b"invalid_key:missing_key", b"rejected"]
    assert idem.stats.duplicates == 13
    ends = Counter(i % 2 for i in range(len(items)))
    assert await committed(kafka_admin, group) == dict(ends)
    await kafka_admin.delete_topics([f"{topic}.dlq"])


async def test_the_store_s_connections_terminated_mid_run_lose_and_double_nothing(
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
    topic = await kafka_topic_factory("fsbpg", partitions=2)
    group = unique("fsbg")
    items = keyed(600, 100)
    await send(kafka_producer, topic, items, 2)
    # the consumer's own pool: its connections are the ones terminated
    app = unique("fsb-kill")
    pool = await asyncpg.create_pool(
        pg_dsn, min_size=2, max_size=8, server_settings={"application_name": app}
    )
    assert pool is not None
    app_store = PostgresStore(pool)
    broker, idem = idempotent_broker(settings, app_store, scope, backoff=(0.05, 0.3))
    sizes: list[int] = []
    batch_app(broker, idem, topic, group, sizes, Counter(), max_records=20, slow=0.02)
    await broker.start()
    kills = 0
    try:
        for _ in range(8):
            await asyncio.sleep(0.25)
            kills += await pg_pool.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = $1) t",
                app,
            )

        async def all_settled() -> bool:
            return idem.stats.processed >= len(items)

        await wait_until(all_settled, 90, "every record to be settled")
        await asyncio.sleep(0.5)
    finally:
        await broker.stop()
        await pool.close()
    assert kills >= 4, f"the terminations must land mid-run ({kills})"
    assert idem.stats.processed < len(items) + 50, "a terminated batch is redelivered, not more"
    counts = await effects_by_key(pg_pool, scope)
    assert counts == Counter({f"k{i}": 1 for i in range(600)})
    ends = Counter(i % 2 for i in range(len(items)))
    assert await committed(kafka_admin, group) == dict(ends)


async def test_a_key_in_progress_elsewhere_holds_its_partition_back_from_that_record(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fsbw", partitions=1)
    group = unique("fsbg")
    items = keyed(10)
    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.2))
    # k4 is another owner's, under a lease (a two-phase attempt elsewhere)
    held = idem.batch_consumer.prepare(to_message_of("k4", items[4][1]))
    assert not isinstance(held, Exception) and isinstance(held, tuple)
    decision = await store.reserve(scope, "k4", held[1])
    assert decision.token is not None
    await send(kafka_producer, topic, items, 1)
    sizes: list[int] = []
    batch_app(broker, idem, topic, group, sizes, Counter())
    await broker.start()
    try:

        async def waiting() -> bool:
            return idem.stats.retries >= 2

        await wait_until(waiting, 30, "the held key to be retried")
        counts = await effects_by_key(pg_pool, scope)
        # the records before it are done; none after it ran ahead of it (partition order)
        assert counts == Counter({f"k{i}": 1 for i in range(4)}), counts
        assert await committed(kafka_admin, group) == {0: 4}
        await store.complete(scope, "k4", decision.token, {"by": "the other owner"})

        async def all_settled() -> bool:
            return idem.stats.processed >= len(items)

        await wait_until(all_settled, 30, "every record to be settled")
    finally:
        await broker.stop()
    counts = await effects_by_key(pg_pool, scope)
    assert counts == Counter({f"k{i}": 1 for i in range(10) if i != 4}), counts
    assert idem.stats.duplicates == 1  # k4: the other owner's result
    assert await committed(kafka_admin, group) == {0: 10}


def to_message_of(key: str, body: bytes) -> Any:
    from consumer_idem import ConsumerMessage

    return ConsumerMessage(body=body, headers={"idempotency-key": key.encode()})


async def test_a_rebalance_between_two_consumers_loses_and_doubles_nothing(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    topic = await kafka_topic_factory("fsbr", partitions=4)
    group = unique("fsbg")
    items = keyed(2000, 200)
    await send(kafka_producer, topic, items, 4)
    apps: list[tuple[KafkaBroker, Idempotency]] = []
    for _ in range(2):
        broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.3))
        batch_app(broker, idem, topic, group, [], Counter(), max_records=20, slow=0.1)
        apps.append((broker, idem))
    first, second = apps
    await first[0].start()
    try:

        async def started() -> bool:
            return first[1].stats.processed >= 200

        await wait_until(started, 30, "the first consumer to be under way")
        await second[0].start()  # the group rebalances mid-run

        async def shared() -> bool:
            return second[1].stats.processed > 0

        await wait_until(shared, 60, "the second consumer to take partitions")
        await first[0].stop()  # and again: its partitions move to the second, mid-run
        assert (await effects_by_key(pg_pool, scope)).total() < 2000, "must stop mid-run"

        async def all_done() -> bool:
            return (await effects_by_key(pg_pool, scope)).total() >= 2000 and (
                await committed(kafka_admin, group)
            ) == dict(Counter(i % 4 for i in range(len(items))))

        await wait_until(all_done, 120, "every record to be done and committed")
        await asyncio.sleep(0.5)
    finally:
        for broker, _ in apps:
            await broker.stop()
    counts = await effects_by_key(pg_pool, scope)
    assert counts == Counter({f"k{i}": 1 for i in range(2000)})


async def start_child(pg_dsn: str, *args: str) -> asyncio.subprocess.Process:
    return await start_process("tests._faststream_batch_child", pg_dsn, *args)


@pytest.mark.parametrize("step", ["handler", "committed", "kafka", "random"])
async def test_a_process_sigkilled_mid_batch_loses_and_doubles_nothing(
    step: str,
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
    topic = await kafka_topic_factory("fsbk", partitions=2)
    group = unique("fsbg")
    items = keyed(400, 50)
    await send(kafka_producer, topic, items, 2)
    ends = dict(Counter(i % 2 for i in range(len(items))))
    rng = random.Random(scope)
    for kill_at in (2, 5):
        if step == "random":  # wherever the kill lands, once some work is done
            proc = await start_child(pg_dsn, topic, group, scope, "none", "0")
            # at most 200 of the 400 by the second kill: a child that takes a batch or two
            # between the poll and the signal still leaves work for the last one
            target = rng.randint(20, 80) * kill_at // 2

            async def under_way(target: int = target) -> bool:
                return (await effects_by_key(pg_pool, scope)).total() >= target

            await wait_until(under_way, 30, "the child to be under way")
            proc.send_signal(signal.SIGKILL)
        else:
            proc = await start_child(pg_dsn, topic, group, scope, step, str(kill_at))
        await asyncio.wait_for(proc.wait(), timeout=60)
        assert proc.returncode == -signal.SIGKILL
    done = (await effects_by_key(pg_pool, scope)).total()
    assert 0 < done < 400, f"the kills must land mid-run ({done})"
    final = await start_child(pg_dsn, topic, group, scope, "none", "0")
    try:

        async def all_done() -> bool:
            return await committed(kafka_admin, group) == ends

        await wait_until(all_done, 90, "every record to be committed")
        await asyncio.sleep(0.5)
    finally:
        final.send_signal(signal.SIGTERM)
        await asyncio.wait_for(final.communicate(), timeout=60)
    counts = await effects_by_key(pg_pool, scope)
    assert counts == Counter({f"k{i}": 1 for i in range(400)})


# --- what is refused, before anything runs (FastStream's in-memory broker) ---------------------


async def test_a_batch_subscriber_with_a_publisher_is_refused(
    store: PostgresStore, scope: str
) -> None:
    broker = KafkaBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY)
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("in", group_id="g", batch=True, ack_policy=AckPolicy.MANUAL)
    @router.publisher("out")
    async def handle(bodies: list[Any], conn: IdempotentConnection) -> Any:
        raise AssertionError("must not run")

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        with pytest.raises(IdempotencyConfigError, match="publishers"):
            await broker.publish_batch({"n": 1}, topic="in", headers={"idempotency-key": "k1"})
    assert await store.get(scope, "k1") is None


async def test_a_two_phase_batch_subscriber_is_refused(store: PostgresStore, scope: str) -> None:
    broker = KafkaBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY, mode="two_phase")
    router = KafkaRouter(middlewares=[idem])

    @router.subscriber("in", group_id="g", batch=True, ack_policy=AckPolicy.MANUAL)
    async def handle(bodies: list[Any]) -> Any:
        raise AssertionError("must not run")

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        with pytest.raises(IdempotencyConfigError, match="transactional"):
            await broker.publish_batch({"n": 1}, topic="in", headers={"idempotency-key": "k1"})
    assert await store.get(scope, "k1") is None


async def test_a_batch_handler_returning_the_wrong_number_of_results_dead_letters_with_why(
    store: PostgresStore, scope: str, pg_pool: asyncpg.Pool, effects: None
) -> None:
    broker = KafkaBroker()
    idem = Idempotency(store, broker=broker, scope=scope, key=KEY)
    router = KafkaRouter(middlewares=[idem])
    dead: list[dict[str, Any]] = []

    @router.subscriber("in", group_id="g", batch=True, ack_policy=AckPolicy.MANUAL)
    async def handle(bodies: list[Any], conn: IdempotentConnection) -> Any:
        return {"one": "result"}  # not a list: the members cannot have their results

    @broker.subscriber("in.dlq", group_id="d")  # on the broker: without the middleware
    async def collect(body: Any, message: Annotated[Any, Context("message")]) -> None:
        dead.append(message.headers)

    broker.include_router(router)
    async with TestKafkaBroker(broker):
        await broker.publish_batch({"n": 1}, topic="in", headers={"idempotency-key": "k1"})
    # the batch rolled back, then each member alone: dead-lettered, saying why
    assert await store.get(scope, "k1") is None
    assert [h["x-dead-letter-reason"] for h in dead] == ["batch_result"]
    assert "one result per body" in dead[0]["x-dead-letter-error"]


async def test_a_member_that_cannot_be_settled_stops_its_partition_s_commit_there(
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
    """The members after one whose settling failed (here: keeping the original of its
    ``unknown`` outcome, the store failing at that step) are decided and committed in Postgres,
    but the partition's Kafka offset must not pass the failed one until it is settled."""
    topic = await kafka_topic_factory("fsbs", partitions=1)
    notices = await kafka_topic_factory("fsbsrec")
    group = unique("fsbg")
    items = keyed(4)
    items[1] = ("amb", b'{"n": -3, "ambiguous": true}')
    await send(kafka_producer, topic, items, 1)
    kept: list[str] = []
    keep = store.redispatch.keep_original

    async def failing_once(scope: str, key: str, notice: Any) -> Any:
        if not kept:
            kept.append("refused")
            raise StoreUnavailable("the store went away")
        kept.append("kept")
        return await keep(scope, key, notice)

    monkeypatch.setattr(store.redispatch, "keep_original", failing_once)
    commits: list[tuple[int, int]] = []  # (offset committed, originals kept by then)
    commit = AIOKafkaConsumer.commit

    async def spy(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        for offset in (offsets or {}).values():
            commits.append((offset, kept.count("kept")))
        await commit(self, offsets)

    monkeypatch.setattr(AIOKafkaConsumer, "commit", spy)
    broker, idem = idempotent_broker(
        settings, store, scope, backoff=(0.05, 0.2), reconcile_destination=notices
    )
    batch_app(broker, idem, topic, group, [], Counter())
    await run_until_committed(broker, kafka_admin, group, {0: 4}, 30)
    assert kept[:2] == ["refused", "kept"]
    assert commits and all(offset <= 1 for offset, done in commits if done == 0), commits
    assert await effects_by_key(pg_pool, scope) == Counter({"k0": 1, "k2": 1, "k3": 1})


# --- deliveries FastStream cannot hand to the handler, and the handler's own acks -------------


def plain_app(
    broker: KafkaBroker,
    idem: Idempotency,
    topic: str,
    group: str,
    is_batch: bool,
    inner: Any = None,
    parser: Any = None,
    **options: Any,
) -> None:
    """A subscriber (a batch one or not) writing one effect row per body; ``inner``: a
    middleware inside the middleware; ``parser``: FastStream's custom parser."""
    router = KafkaRouter(middlewares=[idem] if inner is None else [idem, inner])
    subscribe = router.subscriber(
        topic,
        group_id=group,
        batch=is_batch,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
        **({"max_records": 5} if is_batch else {}),
        **({"parser": parser} if parser is not None else {}),
    )
    register = subscribe(**options) if options else subscribe  # a handler's filter

    async def write(conn: Any, scope: str, keys: list[str], bodies: list[Any]) -> None:
        for key, body in zip(keys, bodies, strict=True):
            await conn.execute(
                "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)", scope, key, body["n"]
            )

    if is_batch:

        @register
        async def many(bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch) -> None:
            await write(current.conn, current.scope, current.keys, bodies)

    else:

        @register
        async def one(body: dict[str, Any], current: CurrentIdempotency) -> None:
            await write(current.conn, current.scope, [current.key], [body])

    broker.include_router(router)


@pytest.mark.parametrize("is_batch", [True, False], ids=["batch", "per-message"])
@pytest.mark.parametrize("fault", ["header", "filter", "swallowed"])
async def test_a_record_faststream_cannot_hand_over_is_dead_lettered_not_skipped(
    is_batch: bool,
    fault: str,
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    """A header value that is not UTF-8 (FastStream's parser refuses the record, and with it its
    whole batch), or a record no handler's filter accepts: FastStream skips it, and the next
    commit would pass it. It is dead-lettered instead, and its batch-mates run; also when an
    exception middleware inside this one swallowed FastStream's error."""
    topic = await kafka_topic_factory("fsbu", partitions=1)
    await kafka_admin.create_topics([NewTopic(f"{topic}.dlq", 1, 1)])
    group = unique("fsbg")
    for i, (key, body) in enumerate(keyed(10)):
        assert key is not None
        headers = [("idempotency-key", key.encode())]
        if fault in ("header", "swallowed") and i == 2:
            headers.append(("trace-bin", b"\xff\xfe\x00\x01"))
        await kafka_producer.send(topic, body, partition=0, headers=headers)
    await kafka_producer.flush()
    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.2))
    options: dict[str, Any] = {}
    if fault == "filter":  # the record (or the batch) holding n = 2 has no handler
        options["filter"] = lambda msg: (
            b'"n": 2}' not in (b"".join(msg.body) if is_batch else msg.body)
        )
    inner = None
    if fault == "swallowed":
        inner = ExceptionMiddleware(handlers={Exception: lambda exc: None})
    plain_app(broker, idem, topic, group, is_batch, inner, **options)
    await run_until_committed(broker, kafka_admin, group, {0: 10}, 30)
    dead = await read_topic(settings.kafka_bootstrap, f"{topic}.dlq", 10, within=3)
    reason = b"no_handler" if fault == "filter" else b"unparseable"
    refused = [2] if fault != "filter" or not is_batch else [0, 1, 2, 3, 4]  # the whole batch
    assert [json.loads(r.value)["n"] for r in dead] == refused
    assert all(dict(r.headers)["x-dead-letter-reason"] == reason for r in dead)
    expected = Counter({f"k{i}": 1 for i in range(10) if i not in refused})
    assert await effects_by_key(pg_pool, scope) == expected
    await kafka_admin.delete_topics([f"{topic}.dlq"])


@pytest.mark.parametrize("is_batch", [True, False], ids=["batch", "per-message"])
async def test_the_handler_s_own_ack_commits_nothing(
    is_batch: bool,
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    """A handler that calls ``await msg.ack()`` (a habit with manual acks) would commit every
    partition's position before its transaction commits; the message it is given (the injected
    one too) is the batch it runs, and its ack does nothing: the middleware settles."""
    topic = await kafka_topic_factory("fsba", partitions=1)
    group = unique("fsbg")
    await send(kafka_producer, topic, keyed(10), 1)
    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.1), max_attempts=1000)
    router = KafkaRouter(middlewares=[idem])
    subscribe = router.subscriber(
        topic,
        group_id=group,
        batch=is_batch,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
    )
    seen: list[int] = []

    @subscribe
    async def handle(body: Any, msg: KafkaMessage, current: CurrentIdempotencyBatch) -> None:
        await msg.ack()
        bodies = body if is_batch else [body]
        assert len(msg.raw_message) == len(bodies) if is_batch else msg.raw_message.offset >= 0
        seen.extend(b["n"] for b in bodies)
        if any(b["n"] == 4 for b in bodies):
            raise ConnectionError("k4's downstream is down")  # retried, never settled

    broker.include_router(router)
    await broker.start()
    try:

        async def stuck() -> bool:
            return seen.count(4) >= 5

        await wait_until(stuck, 30, "k4 to be retried")
        assert await committed(kafka_admin, group) == {0: 4}
    finally:
        await broker.stop()


@pytest.mark.parametrize("is_batch", [True, False], ids=["batch", "per-message"])
async def test_a_parser_outage_is_waited_out_not_dead_lettered(
    is_batch: bool,
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    """A custom parser failing for a while (its schema registry out of reach) says nothing
    about the records: they are delivered again until it parses them, and all run."""
    topic = await kafka_topic_factory("fsbo", partitions=1)
    group = unique("fsbg")
    await send(kafka_producer, topic, keyed(6), 1)
    failures: list[str] = []

    async def parser(msg: Any, original: Any) -> Any:
        if len(failures) < 4:
            failures.append("down")
            raise ConnectionError("schema registry unreachable")
        return await original(msg)

    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.2))
    plain_app(broker, idem, topic, group, is_batch, parser=parser)
    await run_until_committed(broker, kafka_admin, group, {0: 6}, 30)
    assert len(failures) == 4
    assert idem.stats.dead_lettered == 0
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(6)})


def decoded_batches(router: KafkaRouter, topic: str, group: str, decoder: Any) -> Any:
    """A batch subscriber (up to 50 records a batch) with a decoder of its own (or None)."""
    return router.subscriber(
        topic,
        group_id=group,
        batch=True,
        max_records=50,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
        decoder=decoder,
    )


async def committed_up_to(admin: AIOKafkaAdminClient, group: str, count: int) -> None:
    """Wait until the group committed ``count`` records of its one partition."""

    async def done() -> bool:
        return await committed(admin, group) == {0: count}

    await wait_until(done, 30, f"{count} records to be settled")


async def test_the_batch_is_decoded_once_while_its_claim_runs_and_afresh_when_narrowed(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The subscriber's decoder runs for the whole delivery while its claim is in Postgres,
    and the handler's call reuses that (one decode per batch, as without the middleware).
    When members drop out (duplicates) the handler's copy is the narrowed batch, decoded
    afresh; when the decode ahead fails, the handler's call decodes again."""
    topic = await kafka_topic_factory("fsbd", partitions=1)
    group = unique("fsbg")
    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.1))
    router = KafkaRouter(middlewares=[idem])
    claiming: list[bool] = []  # a batch's claim is in flight
    claim_many = store.fast_path.claim_many

    async def claim(*args: Any, **kwargs: Any) -> set[str]:
        claiming.append(True)
        try:
            return await claim_many(*args, **kwargs)
        finally:
            claiming.pop()

    monkeypatch.setattr(store.fast_path, "claim_many", claim)
    decoded: Counter[tuple[int, ...]] = Counter()
    during_claim: Counter[tuple[int, ...]] = Counter()

    async def decoder(msg: KafkaMessage, original: Any) -> Any:
        offsets = tuple(r.offset for r in msg.raw_message)
        decoded[offsets] += 1
        during_claim[offsets] += bool(claiming)
        failing = any(b'"fail_ahead"' in (r.value or b"") for r in msg.raw_message)
        if failing and decoded[offsets] == 1:
            raise ValueError("the first decode of this delivery fails")
        return await original(msg)

    handled: list[tuple[tuple[int, ...], list[Any]]] = []
    wrong: list[tuple[tuple[int, ...], list[Any]]] = []

    @decoded_batches(router, topic, group, decoder)
    async def handle(bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch) -> None:
        run = tuple(m.offset or 0 for m in current.messages)
        if bodies != [json.loads(m.body) for m in current.messages]:
            wrong.append((run, bodies))  # not raised: a failing batch would be retried
        handled.append((run, bodies))

    broker.include_router(router)
    fresh = keyed(20)
    fresh[10] = ("k10", json.dumps({"n": 10, "fail_ahead": True}).encode())
    await broker.start()
    try:
        await send(kafka_producer, topic, fresh[:10], 1)
        await committed_up_to(kafka_admin, group, 10)
        plain = list(handled)
        await send(kafka_producer, topic, fresh[10:], 1)  # k10's delivery fails its decode ahead
        await committed_up_to(kafka_admin, group, 20)
        failing = handled[len(plain) :]
        # new records with earlier ones again among them: the handler runs only the new ones
        await send(kafka_producer, topic, [item for i in range(5) for item in (
            (f"k{20 + i}", json.dumps({"n": 20 + i}).encode()), fresh[i])], 1)  # fmt: skip
        await committed_up_to(kafka_admin, group, 30)
    finally:
        await broker.stop()
    assert not wrong, f"the handler's bodies are not the records it runs: {wrong}"
    assert sorted(b["n"] for _, bodies in handled for b in bodies) == list(range(25))
    for run, _ in plain:  # every member ran: the decode ahead, during the claim, was the handler's
        assert decoded[run] == during_claim[run] == 1, (run, decoded, during_claim)
    for run, _ in failing:
        assert decoded[run] == (2 if 10 in run else 1), (run, decoded)
    later = handled[len(plain) + len(failing) :]
    assert later and all(len(run) < 10 for run, _ in later)
    # each later delivery was decoded whole (ahead) and then narrowed (for the handler)
    assert all(decoded[run] == 1 for run, _ in later)
    assert sum(decoded.values()) > sum(decoded[run] for run, _ in handled)


class _Upcaster(BaseMiddleware):
    """A middleware inside the idempotency one that upgrades every record in place (FastStream's
    batch decoder reads the records): the handler must get the upgraded bodies, as without the
    idempotency middleware, whether or not a duplicate narrowed its batch."""

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        for record in msg.raw_message:
            record.value = json.dumps({**json.loads(record.value), "v": 2}).encode()
        return await call_next(msg)


async def test_the_outboxes_and_an_inner_middleware_s_bodies_belong_to_the_records_run(
    settings: Settings,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    kafka_topic_factory: Any,
    kafka_admin: AIOKafkaAdminClient,
    kafka_producer: AIOKafkaProducer,
) -> None:
    """``current.outboxes[i]`` stays member ``i``'s however the handler rearranges its own
    view (``current.messages``); the handler gets the bodies a middleware inside this one
    made (nothing is decoded ahead of it), whether every record runs or a duplicate drops
    out."""
    topic = await kafka_topic_factory("fsbo", partitions=1)
    announced = await kafka_topic_factory("fsboout")
    group = unique("fsbg")
    broker, idem = idempotent_broker(settings, store, scope, backoff=(0.05, 0.1))
    router = KafkaRouter(middlewares=[idem, _Upcaster])
    handled: list[list[dict[str, Any]]] = []

    @decoded_batches(router, topic, group, None)
    async def handle(bodies: list[dict[str, Any]], current: CurrentIdempotencyBatch) -> None:
        handled.append(bodies)
        current.messages.reverse()  # the handler's own view, in another order
        for i, body in enumerate(bodies):
            current.outboxes[i].publish(announced, {"for": f"k{body['n']}"})

    broker.include_router(router)
    items = keyed(6)
    await broker.start()
    try:
        await send(kafka_producer, topic, items[:3], 1)  # every record runs
        await committed_up_to(kafka_admin, group, 3)
        await send(kafka_producer, topic, [items[0], *items[3:]], 1)  # k0 again: narrowed
        await committed_up_to(kafka_admin, group, 7)
    finally:
        await broker.stop()
    assert [b.get("v") for bodies in handled for b in bodies] == [2] * 6, handled
    rows = await pg_pool.fetch(
        f"SELECT unit_key, body FROM {store.schema}.outbox_messages WHERE scope = $1", scope
    )
    pairs = sorted((r["unit_key"], json.loads(bytes(r["body"]))["for"]) for r in rows)
    assert pairs == [(f"k{i}", f"k{i}") for i in range(6)], pairs
