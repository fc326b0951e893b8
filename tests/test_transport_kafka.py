"""KafkaRunner at its edges, on the real broker and database: what is committed while a record
waits, while a dead letter cannot be written yet or can never be written whole, and after a
worker failed unexpectedly."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import NotEnoughReplicasError

from consumer_idem import (
    ConsumerMessage,
    IdempotentConsumer,
    PostgresStore,
    Verdict,
    fingerprint_payload,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.kafka_offsets import PostgresOffsets
from handlers.payments import record_payment
from tests._payments import ledger_count, payment, read_topic, send_raw, wait_until
from tests._runners import Started
from tests.conftest import unique
from tests.test_consumer_kafka import FAST, committed


@pytest.fixture
def run_id() -> str:
    return f"kt{uuid.uuid4().hex[:8]}"


def ledger(store: PostgresStore, scope: str) -> IdempotentConsumer:
    return idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), backoff=(0.1, 0.5)
    )(record_payment)


class RefusedDeadLetters:
    """The producer takes the runner's dead letters to ``dlq`` but the broker's acknowledgement
    fails (what a leader change or too few in-sync replicas look like), until :meth:`end`."""

    def __init__(self, runner: KafkaRunner, dlq: str) -> None:
        self.refusing = True
        real_send = runner._producer.send

        async def send(topic_name: str, *args: Any, **kwargs: Any) -> Any:
            if topic_name == dlq and self.refusing:
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(NotEnoughReplicasError("injected: too few in-sync replicas"))
                return failed
            return await real_send(topic_name, *args, **kwargs)

        runner._producer.send = send  # type: ignore[method-assign]

    def end(self) -> None:
        self.refusing = False


@pytest.fixture
async def topics(kafka_admin: AIOKafkaAdminClient) -> Any:
    """Creates topics with configs (deleted after the test)."""
    created: list[str] = []

    async def make(name: str, **configs: str) -> str:
        await kafka_admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs)])
        created.append(name)
        return name

    yield make
    if created:
        await kafka_admin.delete_topics(created)


async def test_a_record_held_for_retry_holds_back_every_commit_after_it(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("held")
    held = payment(run_id, 0)
    holder = await store.reserve(scope, "held", fingerprint_payload(held), lease=60)
    items = [({"idempotency-key": b"held"}, held)]
    items += [({"idempotency-key": f"after-{i}".encode()}, payment(run_id, i)) for i in (1, 2)]
    await send_raw(kafka_producer, topic, items)
    running = Started(
        KafkaRunner(ledger(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST)
    )
    try:

        async def waiting() -> bool:
            return running.runner.stats.retries >= 3

        await wait_until(waiting, 20, "the held record to be retried")
        # nothing after the held record ran (order) and nothing at all was committed
        assert await ledger_count(pg_pool, run_id) == 0
        assert running.runner.stats.commits == 0
        assert await committed(settings, run_id, topic) is None
        async with pg_pool.acquire() as conn, conn.transaction():
            await record_payment(ConsumerMessage(held), conn)
            await store.complete(scope, "held", holder.token, None, conn=conn)

        async def all_settled() -> bool:
            return running.runner.stats.processed >= 3

        await wait_until(all_settled, 20, "the held record to be replayed")
    finally:
        await running.finish()
    assert await committed(settings, run_id, topic) == 3


@pytest.mark.parametrize("offsets_in_postgres", [False, True])
async def test_a_record_held_mid_chunk_holds_back_the_commit_of_the_records_after_it(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
    offsets_in_postgres: bool,
) -> None:
    """Two records settle, the third waits (its key is held elsewhere), two more follow in
    the same chunk: the committed offset (in Kafka, and in Postgres) stops at the held one,
    never at the chunk's end, however long it waits."""
    topic = await kafka_topic_factory("midheld")
    held = payment(run_id, 2)
    holder = await store.reserve(scope, "held", fingerprint_payload(held), lease=60)
    items = [({"idempotency-key": f"before-{i}".encode()}, payment(run_id, i)) for i in (0, 1)]
    items += [({"idempotency-key": b"held"}, held)]
    items += [({"idempotency-key": f"after-{i}".encode()}, payment(run_id, i)) for i in (3, 4)]
    await send_raw(kafka_producer, topic, items)
    runner = KafkaRunner(
        ledger(store, scope),
        topics=[topic],
        group_id=run_id,
        consumer_options=FAST,
        offsets_in_postgres=offsets_in_postgres,
        outbox_relay=None,
    )
    running = Started(runner)
    try:

        async def before_committed() -> bool:
            return runner.stats.retries >= 2 and await committed(settings, run_id, topic) == 2

        await wait_until(before_committed, 20, "the records before the held one to commit")
        await asyncio.sleep(1.5)  # more retries, and any commit they would make
        assert await committed(settings, run_id, topic) == 2
        if offsets_in_postgres:
            stored = await PostgresOffsets(store, run_id).load([(topic, 0)])
            assert stored[(topic, 0)][0] == 2
        assert await ledger_count(pg_pool, run_id) == 2  # in order: nothing after it ran
        async with pg_pool.acquire() as conn, conn.transaction():
            await record_payment(ConsumerMessage(held), conn)
            await store.complete(scope, "held", holder.token, None, conn=conn)

        async def all_settled() -> bool:
            return runner.stats.processed >= 5

        await wait_until(all_settled, 20, "the held record to be replayed")
    finally:
        await running.finish()
    assert await committed(settings, run_id, topic) == 5
    assert await ledger_count(pg_pool, run_id) == 5


async def test_a_dead_letter_the_broker_does_not_acknowledge_yet_holds_the_commit(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("dlwait")
    dlq = f"{topic}.dlq"
    await send_raw(
        kafka_producer,
        topic,
        [({}, payment(run_id, 1)), ({"idempotency-key": b"ok-2"}, payment(run_id, 2))],
    )
    runner = KafkaRunner(
        ledger(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST
    )
    refused = RefusedDeadLetters(runner, dlq)
    running = Started(runner)
    try:
        await asyncio.sleep(4)  # several refused attempts
        assert runner.stats.dead_lettered == 0
        assert await committed(settings, run_id, topic) is None
        refused.end()

        async def settled() -> bool:
            return runner.stats.processed >= 2

        await wait_until(settled, 20, "the dead letter to go out once the broker takes it")
    finally:
        await running.finish()
    (copy,) = await read_topic(settings.kafka_bootstrap, dlq, 1)
    assert dict(copy.headers)["x-dead-letter-reason"] == b"invalid_key:missing_key"
    assert await committed(settings, run_id, topic) == 2


async def test_a_dead_letter_copy_too_large_for_its_topic_goes_without_its_body(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    topics: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
) -> None:
    limit = {"max.message.bytes": "20000"}
    topic = await topics(unique("big"), **limit)
    dlq = await topics(f"{topic}.dlq", **limit)
    big = b'{"pad": "' + b"x" * 19_850 + b'"}'  # fits its topic; with our headers it does not
    await send_raw(
        kafka_producer, topic, [({}, big), ({"idempotency-key": b"ok-1"}, payment(run_id, 1))]
    )
    running = Started(
        KafkaRunner(ledger(store, scope), topics=[topic], group_id=run_id, consumer_options=FAST)
    )
    try:

        async def settled() -> bool:
            return running.runner.stats.processed >= 2

        await wait_until(settled, 15, "the partition to move on past the oversized dead letter")
    finally:
        await running.finish()
    (copy,) = await read_topic(settings.kafka_bootstrap, dlq, 1)
    headers = dict(copy.headers)
    assert copy.value in (None, b"")
    assert headers["x-dead-letter-reason"] == b"invalid_key:missing_key"
    assert headers["x-dead-letter-body-dropped"] == str(len(big)).encode()
    assert headers["x-original-topic"] == topic.encode()
    assert headers["x-original-offset"] == b"0"
    assert "MessageSizeTooLarge" in headers["x-dead-letter-error"].decode()
    assert store.metrics.count("dead_letter_body_dropped", scope) == 1
    assert await ledger_count(pg_pool, run_id) == 1
    assert await committed(settings, run_id, topic) == 2


class FailsOnce:
    """A processor whose first ``process_batch`` raises: a bug, or an error nobody classified."""

    batch = False

    def __init__(self, inner: IdempotentConsumer) -> None:
        self.inner = inner
        self.store = inner.store
        self.scope = inner.scope
        self.failed = False

    async def process(self, message: ConsumerMessage) -> Verdict:
        return await self.inner.process(message)

    async def process_batch(self, messages: Sequence[ConsumerMessage]) -> list[Verdict]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("unexpected failure in the worker")
        return await self.inner.process_batch(messages)


async def test_a_worker_that_dies_is_logged_and_its_partition_resumes_from_what_is_settled(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    demo_tables: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    run_id: str,
    scope: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = await kafka_topic_factory("dies")
    items = [({"idempotency-key": f"d-{i}".encode()}, payment(run_id, i)) for i in range(5)]
    await send_raw(kafka_producer, topic, items)
    processor = FailsOnce(ledger(store, scope))
    caplog.set_level(logging.ERROR, logger="consumer_idem.transports.kafka")
    running = Started(
        KafkaRunner(processor, topics=[topic], group_id=run_id, consumer_options=FAST)
    )
    try:

        async def settled() -> bool:
            return running.runner.stats.processed >= 5 or running.task.done()

        await wait_until(settled, 20, "the partition to resume")
        assert not running.task.done(), "the runner stopped instead of resuming the partition"
        await send_raw(kafka_producer, topic, [({"idempotency-key": b"d-5"}, payment(run_id, 5))])

        async def more() -> bool:
            return running.runner.stats.processed >= 6

        await wait_until(more, 20, "a later record to run")
    finally:
        await running.finish()
    assert processor.failed and running.runner.stats.failures == 1
    assert any(
        "unexpected failure in the worker" in r.getMessage() or r.exc_info for r in caplog.records
    )
    assert await ledger_count(pg_pool, run_id) == 6
    assert await committed(settings, run_id, topic) == 6


async def test_a_store_never_migrated_stops_the_runner_at_start(
    pg_pool: asyncpg.Pool, kafka_topic_factory: Any, run_id: str, scope: str
) -> None:
    from consumer_idem.errors import SchemaMissing

    unmigrated = PostgresStore(pg_pool, schema=f"never_{uuid.uuid4().hex[:8]}")
    topic = await kafka_topic_factory("nomig")
    runner = KafkaRunner(ledger(unmigrated, scope), topics=[topic], group_id=run_id)
    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await runner.run(asyncio.Event())
