"""The transactional outbox against real PostgreSQL and Kafka: what a unit publishes leaves
once, after its COMMIT, with a derived idempotency-key; nothing of a rolled-back unit or a
replayed duplicate; relays share the work without ever sending a row twice at once; order per
destination key; a refused message is parked, visible, and never dropped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    ConsumerMessage,
    DomainError,
    NoOutbox,
    OutcomeKind,
    PoisonMessage,
    PostgresStore,
    header,
    idempotent_consumer,
    run_transactional,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.outbox import (
    OutboxRelay,
    OutboxService,
    OutgoingMessage,
    outbox_for,
    outgoing_key,
)
from consumer_idem.stores.postgres import migrate
from consumer_idem.transports.kafka import KafkaOutboxSender, KafkaRunner
from tests._cli import cli
from tests._outbox import FP, outbox_store, producer, rows, sent_keys
from tests._outbox import header as header_of
from tests._payments import read_topic, wait_until


@pytest.fixture(autouse=True)
async def _migrated(store: PostgresStore) -> None:
    """Every test here runs on the session's migrated schema (through a store of its own)."""


async def test_a_committed_unit_is_sent_once_in_order_with_derived_keys(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool, relay_after=60)  # no relay could have sent these
    topic = await kafka_topic_factory("outbox", partitions=3)
    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
    ):

        async def book(conn: asyncpg.Connection) -> str:
            await conn.execute("SELECT 1")
            box = outbox_for(conn)
            for n in range(3):
                box.publish(topic, {"n": n}, key="customer-1")
            box.publish(topic, b"\x00raw", headers={"x-trace": "abc"})
            return "booked"

        outcome = await run_transactional(store, scope, "k1", FP, book)
        assert outcome.kind is OutcomeKind.EXECUTED
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
    records = await read_topic(settings.kafka_bootstrap, topic, 4)
    assert len(records) == 4
    keyed = [r for r in records if r.key == b"customer-1"]
    assert [json.loads(r.value)["n"] for r in keyed] == [0, 1, 2]  # one key: publish order
    run = str((await rows(store, scope))[0]["run"])  # the run that wrote them
    assert [header_of(r) for r in keyed] == [outgoing_key(scope, "k1", n, run) for n in range(3)]
    assert dict(keyed[0].headers)["content-type"] == b"application/json"
    raw = next(r for r in records if r.key is None)
    assert raw.value == b"\x00raw" and header_of(raw, "x-trace") == "abc"
    assert header_of(raw) == outgoing_key(scope, "k1", 3, run)
    assert [(r["status"], r["attempts"]) for r in await rows(store, scope)] == [("sent", 1)] * 4


async def test_a_rolled_back_unit_publishes_nothing_and_its_retry_publishes_once(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool)  # due at once: a relay pass would send any row there is
    topic = await kafka_topic_factory("outbox")
    attempts: Counter[str] = Counter()

    async def book(conn: asyncpg.Connection, key: str, how: str) -> str:
        attempts[key] += 1
        outbox_for(conn).publish(topic, {"key": key, "attempt": attempts[key]})
        if how == "raise" and attempts[key] == 1:
            raise RuntimeError("the handler failed after publishing")
        if how == "domain":
            raise DomainError({"declined": True})
        if how == "abort":  # swallowed without a savepoint: COMMIT answers ROLLBACK
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await conn.execute("SELECT 1/0")
        return "booked"

    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
    ):
        for key, how in (("r1", "raise"), ("d1", "domain"), ("a1", "abort")):
            outcome = await run_transactional(
                store, scope, key, FP, lambda c, k=key, h=how: book(c, k, h)
            )
            assert outcome.kind is not OutcomeKind.EXECUTED or how == "domain", (how, outcome)
        assert await rows(store, scope) == []
        assert (await service.relay.run_once()).sent == 0
        assert await read_topic(settings.kafka_bootstrap, topic, 1, within=3) == []

        retried = await run_transactional(store, scope, "r1", FP, lambda c: book(c, "r1", "raise"))
        assert retried.kind is OutcomeKind.EXECUTED
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
    records = await read_topic(settings.kafka_bootstrap, topic, 2, within=5)
    assert [json.loads(r.value) for r in records] == [{"key": "r1", "attempt": 2}]
    # the retry's message carries the key of the run that committed it, as its row says
    (row,) = await rows(store, scope)
    assert (
        header_of(records[0])
        == row["idempotency_key"]
        == outgoing_key(scope, "r1", 0, str(row["run"]))
    )


async def test_a_replayed_duplicate_publishes_nothing(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    kafka_topic_factory: Any,
    kafka_producer: Any,
) -> None:
    """End to end through a KafkaRunner: the same message three times, one event."""
    store = outbox_store(pg_pool, relay_after=60)
    source = await kafka_topic_factory("outbox-in")
    events = await kafka_topic_factory("outbox-out")
    ran: list[str] = []

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        ran.append(message.body.decode())
        outbox_for(conn).publish(events, message.body, key=b"p1")

    for _ in range(3):
        await kafka_producer.send_and_wait(
            source, value=b'{"payment_id":"p1"}', headers=[("idempotency-key", b"pay-1")]
        )
    runner = KafkaRunner(book, topics=[source], group_id=f"g-{scope}", outbox_relay=None)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await wait_until(lambda: _true(runner.stats.processed >= 3), 60, "3 deliveries settled")
    finally:
        stop.set()
        await task
    assert ran == ['{"payment_id":"p1"}'] and runner.stats.duplicates == 2
    records = await read_topic(settings.kafka_bootstrap, events, 2, within=5)
    assert len(records) == 1 and header_of(records[0]) == (await sent_keys(store, scope))["pay-1"]
    assert [r["status"] for r in await rows(store, scope)] == ["sent"]


async def _true(value: bool) -> bool:
    return value


class Watching:
    """Wraps a real sender: records which rows are being sent at each moment, and holds every
    batch a while so that two relays overlap in time."""

    def __init__(self, inner: KafkaOutboxSender, hold: float = 0.05) -> None:
        self.inner = inner
        self.hold = hold
        self.in_flight: set[int] = set()
        self.overlaps: list[set[int]] = []
        self.sent: Counter[int] = Counter()

    def permanent(self, exc: BaseException) -> bool:
        return self.inner.permanent(exc)

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        ids = {m.id for m in messages if m.id is not None}
        if ids & self.in_flight:
            self.overlaps.append(ids & self.in_flight)
        self.in_flight |= ids
        try:
            await asyncio.sleep(self.hold)
            return await self.inner.send_batch(messages)
        finally:
            self.in_flight -= ids
            self.sent.update(ids)


async def commit_units(store: PostgresStore, scope: str, topic: str, n: int) -> None:
    """``n`` committed units of one message each, with no dispatcher: left to a relay."""
    for i in range(n):

        async def book(conn: asyncpg.Connection, i: int = i) -> None:
            await conn.execute("SELECT 1")
            outbox_for(conn).publish(topic, {"i": i}, key=f"c{i % 7}")

        assert (await run_transactional(store, scope, f"u{i}", FP, book)).kind is (
            OutcomeKind.EXECUTED
        )


async def test_two_relays_never_send_the_same_row_concurrently(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool)
    topic = await kafka_topic_factory("outbox-relay", partitions=2)
    await commit_units(store, scope, topic, 200)
    async with producer(settings.kafka_bootstrap) as p:
        watching = Watching(KafkaOutboxSender(p))
        relays = [OutboxRelay(store, watching, scopes=[scope], batch=10) for _ in range(2)]
        await asyncio.gather(*(relay.run_once() for relay in relays))
    assert watching.overlaps == []
    assert len(watching.sent) == 200 and set(watching.sent.values()) == {1}
    assert all(relay.total.sent > 0 for relay in relays), [r.total for r in relays]
    assert sum(relay.total.sent for relay in relays) == 200
    records = await read_topic(settings.kafka_bootstrap, topic, 200)
    assert len(records) == 200 and len({header_of(r) for r in records}) == 200
    assert {r["status"] for r in await rows(store, scope)} == {"sent"}


async def test_a_message_waits_while_an_earlier_one_of_its_unit_is_held(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    """Order per destination key: a relay must not send the second message of a unit while
    another relay holds the first (nor while the first backs off after a failure)."""
    store = outbox_store(pg_pool)
    topic = await kafka_topic_factory("outbox-order")

    async def book(conn: asyncpg.Connection) -> None:
        box = outbox_for(conn)
        box.publish(topic, b"first", key=b"same")
        box.publish(topic, b"second", key=b"same")
        box.publish(topic, b"other", key=b"elsewhere")

    await run_transactional(store, scope, "u1", FP, book)
    first = (await rows(store, scope))[0]
    async with producer(settings.kafka_bootstrap) as p:
        relay = OutboxRelay(store, KafkaOutboxSender(p), scopes=[scope])
        async with pg_pool.acquire() as holder:  # another relay holds the first message
            await holder.execute("BEGIN")
            await holder.execute(
                f"SELECT 1 FROM {store.outbox.table} WHERE id = $1 FOR UPDATE", first["id"]
            )
            assert (await relay.run_once()).sent == 1  # only the other key's message
            await holder.execute("ROLLBACK")
        # the first one backs off after a failure: the second still waits for it
        await pg_pool.execute(
            f"UPDATE {store.outbox.table} SET due_at = now() + interval '1 hour' WHERE id = $1",
            first["id"],
        )
        assert (await relay.run_once()).sent == 0
        await pg_pool.execute(
            f"UPDATE {store.outbox.table} SET due_at = now() WHERE id = $1", first["id"]
        )
        assert (await relay.run_once()).sent == 2
    records = await read_topic(settings.kafka_bootstrap, topic, 3)
    assert [r.value for r in records if r.key == b"same"] == [b"first", b"second"]


async def test_a_refused_message_is_parked_with_its_reason_and_the_others_go(
    settings: Settings,
    pg_dsn: str,
    pg_pool: asyncpg.Pool,
    scope: str,
    kafka_topic_factory: Any,
) -> None:
    store = outbox_store(pg_pool, relay_after=60)
    topic = await kafka_topic_factory("outbox-parked")

    async def book(conn: asyncpg.Connection) -> None:
        box = outbox_for(conn)
        box.publish(topic, b"x" * 2_000_000, key=b"big")  # over the producer's request limit
        box.publish(topic, b"fits", key=b"small")

    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
    ):
        await run_transactional(store, scope, "u1", FP, book)
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
        stored = await rows(store, scope)
        assert [r["status"] for r in stored] == ["parked", "sent"]
        assert "MessageSizeTooLarge" in stored[0]["last_error"]
        parked = await store.outbox.parked(scope=scope)
        assert [(m.position, m.destination) for m in parked] == [(0, topic)]
        stats = (await store.outbox.stats(scope)).scope(scope)
        assert stats is not None and (stats.parked, stats.pending, stats.sent) == (1, 0, 1)

        code, out, _ = await cli("stats", "--scope", scope, "--json", dsn=pg_dsn)
        assert code == 0
        outbox = json.loads(out)["outbox"]
        assert outbox["parked"] == 1 and outbox["scopes"][scope]["parked"] == 1
        code, out, _ = await cli("stats", "--scope", scope, dsn=pg_dsn)
        assert code == 0 and "1 parked" in out

        # an operator sends it again: refused again, parked again, never dropped or pruned
        assert await store.outbox.unpark(scope=scope) == 1
        report = await OutboxRelay(store, KafkaOutboxSender(p), retention=0).run_once()
        assert report.parked == 1
    assert [r["status"] for r in await rows(store, scope)] == ["parked"]
    records = await read_topic(settings.kafka_bootstrap, topic, 1)
    assert [r.value for r in records] == [b"fits"]


async def test_batch_mode_each_message_is_its_own_unit(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool, relay_after=60)
    topic = await kafka_topic_factory("outbox-batch")
    seen_no_message: list[NoOutbox] = []

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=True)
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        try:
            outbox_for(conn)
        except NoOutbox as exc:
            seen_no_message.append(exc)
        for message in messages:
            if message.json().get("poison"):
                raise PoisonMessage("bad_payment")
            outbox_for(conn, message).publish(topic, message.body)

    def message(i: int, poison: bool = False) -> ConsumerMessage:
        body = json.dumps({"i": i, "poison": poison}).encode()
        return ConsumerMessage(body=body, headers={"idempotency-key": f"m{i}".encode()})

    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
    ):
        verdicts = await book.process_batch([message(i) for i in range(5)])
        assert [v.action.value for v in verdicts] == ["ack"] * 5
        # a poison member: the batch rolls back (its messages with it), then one by one
        verdicts = await book.process_batch([message(5), message(6, poison=True), message(7)])
        assert [v.action.value for v in verdicts] == ["ack", "dead_letter", "ack"]
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
    assert seen_no_message  # a batch handler must say which message an outgoing one is of
    records = await read_topic(settings.kafka_bootstrap, topic, 7)
    by_key = {header_of(r): json.loads(r.value)["i"] for r in records}
    assert len(records) == 7
    keys = await sent_keys(store, scope)
    assert by_key == {keys[f"m{i}"]: i for i in (0, 1, 2, 3, 4, 5, 7)}


async def test_outbox_for_refuses_where_nothing_would_commit_the_message(
    pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    async with pg_pool.acquire() as conn:
        with pytest.raises(NoOutbox):
            outbox_for(conn)
    kept: list[Any] = []

    async def book(conn: asyncpg.Connection) -> None:
        kept.append(conn)
        box = outbox_for(conn)
        with pytest.raises(ValueError, match="idempotency-key"):
            box.publish("t", b"x", headers={"Idempotency-Key": "mine"})
        with pytest.raises(TypeError):
            box.publish("t", {1, 2})
        with pytest.raises(ValueError):
            box.publish("", b"x")

    await run_transactional(store, scope, "u1", FP, book)
    with pytest.raises(NoOutbox):  # the unit is over: its connection is someone else's now
        outbox_for(kept[0])
    assert await rows(store, scope) == []


async def test_relay_prunes_sent_rows_and_sets_the_gauges(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    store = outbox_store(pg_pool)
    topic = await kafka_topic_factory("outbox-gauges")
    await commit_units(store, scope, topic, 5)
    async with producer(settings.kafka_bootstrap) as p:
        relay = OutboxRelay(store, KafkaOutboxSender(p), scopes=[scope], retention=3600)
        await relay.update_gauges()
        assert store.metrics.gauge_value("outbox_pending", scope) == 5
        oldest = store.metrics.gauge_value("outbox_oldest_pending_seconds", scope)
        assert oldest is not None and oldest >= 0
        report = await relay.run_once()
        assert (report.sent, report.pruned) == (5, 0)  # kept for the retention
        assert store.metrics.gauge_value("outbox_pending", scope) == 0
        assert len(await rows(store, scope)) == 5
        pruning = OutboxRelay(store, KafkaOutboxSender(p), scopes=[scope], retention=0)
        assert (await pruning.run_once()).pruned >= 5
    assert await rows(store, scope) == []


async def test_the_migration_upgrades_an_install_without_the_outbox(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        schema = f"outbox_upgrade_{abs(hash(pg_dsn)) % 10_000}"
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await migrate.apply(conn, schema)
        # an install from before the outbox: everything but version 5
        await conn.execute(f'DROP TABLE "{schema}".outbox_messages')
        await conn.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 5')
        assert await migrate.apply(conn, schema) == [5]
        assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".outbox_messages') == 0
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    finally:
        await conn.close()


async def test_marking_a_big_batch_after_many_small_marks_stays_fast(pg_dsn: str) -> None:
    """A prepared mark statement settles on a generic plan made for a few rows (a consumer's
    single units); reused for a batch of thousands it compared every row with every other
    (seconds). The marks are planned for their own rows each time."""
    from consumer_idem.outbox import UnitOutbox

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)  # one connection: its plans
    assert pool is not None
    store = outbox_store(pool)
    scope = f"marks-{uuid.uuid4().hex[:8]}"
    try:
        for n in range(20):  # the single units' marks: a few rows each
            few = [UnitOutbox(scope, f"small-{n}").publish("t", b"x") for _ in range(3)]
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(store.outbox.insert_sql(few))
            assert await store.outbox.mark_sent(few) == 3
        batches = [
            [UnitOutbox(scope, f"big-{b}-{i}").publish("t", b"x") for i in range(3000)]
            for b in range(3)
        ]
        for batch in batches:
            async with pool.acquire() as conn, conn.transaction():
                await store.outbox.stage(conn, batch)
        started = time.perf_counter()
        for batch in batches:
            assert await store.outbox.mark_sent(batch) == 3000
        assert time.perf_counter() - started < 5.0  # about 0.1 s; quadratic: tens of seconds
    finally:
        await pool.execute(f"DELETE FROM {store.outbox.table} WHERE scope = $1", scope)
        await pool.close()
