"""Who an outgoing message is, and who sends it, against real PostgreSQL, Kafka and RabbitMQ: a
key that runs again as new work publishes new messages (new idempotency-keys) while copies of
one row keep its key; a relay sends only the messages of its own sender's route; a destination
that is down never holds back a healthy one; an outbox kept past its unit refuses to publish;
a handler that ends the transaction with messages pending is an error naming them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aio_pika
import asyncpg
import pytest

from consumer_idem import (
    NoOutbox,
    OutboxMessagesLost,
    OutcomeKind,
    PostgresStore,
    run_transactional,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.outbox import OutboxRelay, OutboxService, UnitOutbox, outbox_for, outgoing_key
from consumer_idem.transports.kafka import KafkaOutboxSender
from consumer_idem.transports.rabbit import RabbitOutboxSender
from tests._migrations import apply_by_hand
from tests._outbox import FP, outbox_store, producer, rows
from tests._outbox import header as header_of
from tests._payments import read_topic


@pytest.fixture(autouse=True)
async def _migrated(store: PostgresStore) -> None:
    """Every test here runs on the session's migrated schema (through a store of its own)."""


async def _queued(connection: Any, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message waiting in ``queue`` (taken off it)."""
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(queue, passive=True)
        taken = []
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            taken.append(message)
        return taken
    finally:
        await channel.close()


async def test_a_key_run_again_as_new_work_publishes_new_keys_and_copies_keep_theirs(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    """Once its record is gone (retention, an operator's evict) a key is new work: its next
    run's message must not carry the first run's idempotency-key (the next consumer would drop
    it as a duplicate, or dead-letter it as a misuse). A re-send of one row keeps its key."""
    store = outbox_store(pg_pool, relay_after=60)
    topic = await kafka_topic_factory("outbox-runs")

    async def book(conn: asyncpg.Connection) -> str:
        outbox_for(conn).publish(topic, {"order": "o1"}, key=b"o1")
        return "booked"

    async with (
        producer(settings.kafka_bootstrap) as p,
        OutboxService(store, KafkaOutboxSender(p), relay_interval=None) as service,
    ):
        assert (await run_transactional(store, scope, "o1", FP, book)).kind is OutcomeKind.EXECUTED
        await pg_pool.execute(f"DELETE FROM {store.table} WHERE scope = $1", scope)  # pruned
        assert (await run_transactional(store, scope, "o1", FP, book)).kind is OutcomeKind.EXECUTED
        assert service.dispatcher is not None and await service.dispatcher.drain(10)
        first, second = await rows(store, scope)
        assert first["run"] != second["run"]
        # the relay sends the first run's row again (its mark was lost): the same key as before
        await pg_pool.execute(
            f"UPDATE {store.outbox.table} SET status = 'pending', due_at = now() WHERE id = $1",
            first["id"],
        )
        resent = await OutboxRelay(store, KafkaOutboxSender(p), scopes=[scope]).run_once()
        assert resent.sent == 1
    records = await read_topic(settings.kafka_bootstrap, topic, 3)
    keys = [header_of(r) for r in records]
    assert keys == [first["idempotency_key"], second["idempotency_key"], first["idempotency_key"]]
    assert len(set(keys)) == 2


async def test_a_relay_sends_only_its_own_routes_messages(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    kafka_topic_factory: Any,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    """A Kafka unit's message left pending (here: the dispatch queue takes none) is not a
    RabbitMQ relay's, even one for every scope: it stays pending for a Kafka relay. A row that
    records no route (written before routes were) goes only to a relay naming its scope."""
    store = outbox_store(pg_pool)  # due at once for any relay
    topic = await kafka_topic_factory("outbox-route")

    async def book(conn: asyncpg.Connection) -> str:
        outbox_for(conn).publish(topic, {"order": "o1"})
        return "booked"

    rabbit = RabbitOutboxSender(amqp_connection)
    async with producer(settings.kafka_bootstrap) as p:
        kafka = KafkaOutboxSender(p, cluster=settings.kafka_bootstrap)
        async with OutboxService(store, kafka, relay_interval=None, dispatch={"max_queued": 0}):
            assert (await run_transactional(store, scope, "o1", FP, book)).kind is (
                OutcomeKind.EXECUTED
            )
        (row,) = await rows(store, scope)
        assert (row["status"], row["route"]) == ("pending", kafka.route)

        assert (await OutboxRelay(store, rabbit).run_once()).sent == 0  # every scope
        assert (await OutboxRelay(store, rabbit, scopes=[scope]).run_once()).sent == 0
        assert [r["status"] for r in await rows(store, scope)] == ["pending"]
        assert (await OutboxRelay(store, kafka).run_once()).sent == 1

        # a row from before routes were recorded: only a relay that names its scope sends it
        await pg_pool.execute(
            f"UPDATE {store.outbox.table} SET status = 'pending', route = NULL WHERE id = $1",
            row["id"],
        )
        assert (await OutboxRelay(store, rabbit).run_once()).sent == 0
        assert (await OutboxRelay(store, kafka).run_once()).sent == 0
        assert (await OutboxRelay(store, kafka, scopes=[scope]).run_once()).sent == 1
    records = await read_topic(settings.kafka_bootstrap, topic, 3, within=5)
    assert len(records) == 2  # the Kafka relay's two sends, nothing through RabbitMQ
    channel = await amqp_connection.channel()
    with pytest.raises(aio_pika.exceptions.ChannelClosed):  # no queue named after the topic
        await channel.declare_queue(topic, passive=True)


async def test_a_dead_destination_never_holds_back_a_healthy_one(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    queue_name: str,
    amqp_connection: aio_pika.abc.AbstractConnection,
) -> None:
    """1,000 messages wait for a queue that does not exist (their first sends failed, they back
    off); the messages committed after them for a healthy queue go out on the next pass."""
    store = outbox_store(pg_pool)
    dead, healthy = f"{queue_name}-dead", f"{queue_name}-ok"
    channel = await amqp_connection.channel()
    await channel.declare_queue(healthy, durable=True)
    sender = RabbitOutboxSender(amqp_connection, declare=False)  # the dead one is never made
    relay = OutboxRelay(store, sender, scopes=[scope], send_timeout=5.0)

    async def flood(conn: asyncpg.Connection) -> None:
        box = outbox_for(conn)
        for n in range(1000):
            box.publish(dead, {"n": n})

    async def one(conn: asyncpg.Connection, n: int) -> None:
        outbox_for(conn).publish(healthy, {"n": n})

    assert (await run_transactional(store, scope, "flood", FP, flood)).kind is (
        OutcomeKind.EXECUTED
    )
    first = await relay.run_once()
    assert first.sent == 0 and first.failed > 0  # the dead queue: its first sends fail
    for n in range(10):
        await run_transactional(store, scope, f"ok{n}", FP, lambda c, n=n: one(c, n))

    started = time.monotonic()
    got: list[Any] = []
    while len(got) < 10 and time.monotonic() - started < 10:
        await relay.run_once()
        got += await _queued(amqp_connection, healthy)
        await asyncio.sleep(0.2)
    assert len(got) == 10, f"{len(got)} of 10 healthy messages sent in 10 s"
    waiting = [r for r in await rows(store, scope) if r["destination"] == dead]
    assert len(waiting) == 1000 and {r["status"] for r in waiting} == {"pending"}
    await channel.queue_delete(healthy)


async def test_an_outbox_kept_past_its_unit_refuses_to_publish(
    pg_pool: asyncpg.Pool, scope: str
) -> None:
    store = outbox_store(pg_pool, relay_after=60)
    kept: list[UnitOutbox] = []

    async def book(conn: asyncpg.Connection) -> str:
        kept.append(outbox_for(conn))
        kept[0].publish("orders", b"inside")
        return "booked"

    assert (await run_transactional(store, scope, "k1", FP, book)).kind is OutcomeKind.EXECUTED
    with pytest.raises(NoOutbox, match="has ended"):
        kept[0].publish("orders", b"after the unit")
    assert [r["body"] for r in await rows(store, scope)] == [b"inside"]


async def test_a_handler_commit_with_pending_messages_is_an_error_naming_them(
    pg_pool: asyncpg.Pool, scope: str
) -> None:
    store = outbox_store(pg_pool, relay_after=60)

    async def book(conn: asyncpg.Connection) -> str:
        outbox_for(conn).publish("orders.booked", b"o1")
        outbox_for(conn).publish("audit", b"o1")
        await conn.execute("COMMIT")  # a handler must never end the unit's transaction
        return "booked"

    outcome = await run_transactional(store, scope, "k1", FP, book)
    assert outcome.kind is OutcomeKind.UNKNOWN
    assert isinstance(outcome.error, OutboxMessagesLost)
    assert "'orders.booked'" in str(outcome.error) and "'audit'" in str(outcome.error)
    assert len(outcome.error.messages) == 2
    assert await rows(store, scope) == []
    # counted where monitoring sees it: the record cannot say it (the handler's COMMIT made its
    # claim durable, so a redelivery replays) and nothing is left to send
    assert store.metrics.count("outbox_lost", scope) == 2
    again = await run_transactional(store, scope, "k1", FP, book)
    assert again.kind is OutcomeKind.REPLAYED and await rows(store, scope) == []


async def test_rows_from_before_runs_and_routes_keep_their_key_and_go_to_a_scoped_relay(
    settings: Settings, pg_dsn: str, kafka_topic_factory: Any
) -> None:
    """A store as version 8 left it, with a message pending: after the upgrade the message has
    no run and no route; a relay for every scope leaves it, one naming its scope sends it with
    the key it was written with."""
    schema = f"outbox_v8_{uuid.uuid4().hex[:10]}"
    topic = await kafka_topic_factory("outbox-v8")
    conn = await asyncpg.connect(pg_dsn)
    pool = None
    try:
        await apply_by_hand(conn, schema, upto=8)
        old_key = outgoing_key("s", "k", 0)  # what version 8 derived
        await conn.execute(
            f'INSERT INTO "{schema}".outbox_messages (scope, unit_key, position, destination,'
            " body, header_names, header_values, idempotency_key)"
            " VALUES ('s', 'k', 0, $1, 'old', ARRAY['idempotency-key'], ARRAY[$2::bytea], $3)",
            topic,
            old_key.encode(),
            old_key,
        )
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
        assert pool is not None
        store = PostgresStore(pool, schema=schema)
        store.outbox.relay_after = 0
        assert 9 in await store.migrate()
        (row,) = await rows(store, "s")
        assert (row["run"], row["route"], row["status"]) == (None, None, "pending")
        async with producer(settings.kafka_bootstrap) as p:
            kafka = KafkaOutboxSender(p, cluster=settings.kafka_bootstrap)
            assert (await OutboxRelay(store, kafka).run_once()).sent == 0
            assert (await OutboxRelay(store, kafka, scopes=["s"]).run_once()).sent == 1
        (record,) = await read_topic(settings.kafka_bootstrap, topic, 1)
        assert record.value == b"old" and header_of(record) == old_key
    finally:
        if pool is not None:
            await pool.close()
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


async def test_messages_left_on_another_route_are_reported_and_can_be_moved(
    settings: Settings,
    pg_pool: asyncpg.Pool,
    scope: str,
    kafka_topic_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route names the cluster as it was configured: after a redeploy that spells it
    otherwise (a bootstrap list with a broker added, a DNS name for an address) or moves the
    scope to another transport, the messages left pending under the old route are no relay's.
    The scope's relay must say so (a warning naming the route, the ``outbox_stranded`` gauge),
    and an operator can move them to its route, where they go out with the key they had."""
    store = outbox_store(pg_pool)
    topic = await kafka_topic_factory("outbox-stranded")
    old_route = "kafka:kafka-a.internal:9092,kafka-b.internal:9092"

    async def book(conn: asyncpg.Connection) -> str:
        outbox_for(conn).publish(topic, {"order": "o1"})
        return "booked"

    async with producer(settings.kafka_bootstrap) as p:
        before = KafkaOutboxSender(p, cluster="kafka-b.internal:9092,kafka-a.internal:9092")
        assert before.route == old_route
        async with OutboxService(store, before, relay_interval=None, dispatch={"max_queued": 0}):
            assert (await run_transactional(store, scope, "o1", FP, book)).kind is (
                OutcomeKind.EXECUTED
            )
        (row,) = await rows(store, scope)

        # redeployed: the same cluster, spelled as the new configuration spells it
        relay = OutboxRelay(
            store, KafkaOutboxSender(p, cluster=settings.kafka_bootstrap), scopes=[scope]
        )
        relay.stranded_after = 0.0
        with caplog.at_level("WARNING", logger="consumer_idem.outbox"):
            assert (await relay.run_once()).sent == 0  # not its route: never sent blindly
        assert store.metrics.gauge_value("outbox_stranded", scope) == 1
        warned = [r.getMessage() for r in caplog.records if "outbox_stranded" in r.getMessage()]
        assert len(warned) == 1 and old_route in warned[0] and "reroute" in warned[0]

        moved = await store.outbox.reroute(old_route, relay.route, scope=scope)
        assert moved == 1
        assert (await relay.run_once()).sent == 1
        assert store.metrics.gauge_value("outbox_stranded", scope) == 0
    (record,) = await read_topic(settings.kafka_bootstrap, topic, 1, within=5)
    assert dict(record.headers)["idempotency-key"].decode() == row["idempotency_key"]


async def test_a_relay_pass_ends_while_new_messages_keep_coming(
    settings: Settings, pg_pool: asyncpg.Pool, scope: str, kafka_topic_factory: Any
) -> None:
    """A pass sends what is due and ends: under a steady flow of new messages (here: no
    dispatch, every message is the relay's) it must not chase them batch after batch forever,
    or its pruning, its gauges and its stop would never come."""
    store = outbox_store(pg_pool)  # due for a relay at once
    topic = await kafka_topic_factory("outbox-steady")
    flowing = asyncio.Event()
    flowing.set()

    async def flow(lane: int) -> None:
        n = 0
        while flowing.is_set():
            n += 1

            async def book(conn: asyncpg.Connection, n: int = n) -> str:
                outbox_for(conn).publish(topic, {"n": n})
                return "booked"

            await run_transactional(store, scope, f"k{lane}-{n}", FP, book)

    class Unhurried(KafkaOutboxSender):  # a broker that takes its time: messages pile up
        async def send_batch(self, messages: Any) -> list[BaseException | None]:
            await asyncio.sleep(0.2)
            return await super().send_batch(messages)

    async with producer(settings.kafka_bootstrap) as p:
        relay = OutboxRelay(store, Unhurried(p, cluster="steady"), scopes=[scope])
        flowing_task = asyncio.gather(*(flow(lane) for lane in range(4)))
        try:
            await asyncio.sleep(0.5)
            started = time.monotonic()
            report = await asyncio.wait_for(relay.run_once(), 20)
            assert report.sent > 0
            assert time.monotonic() - started < 5, "the pass chased the new messages"
        finally:
            flowing.clear()
            await flowing_task


def _rows_read(node: dict[str, Any]) -> int:
    """Rows an executed plan read from tables and indexes (kept or filtered out), in all."""
    own = 0
    if "Relation Name" in node or "Index Name" in node:
        seen = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        own = int(seen * node["Actual Loops"])
    return own + sum(_rows_read(child) for child in node.get("Plans", []))


async def test_a_relays_claim_reads_its_destinations_not_the_backlog(
    pg_pool: asyncpg.Pool, scope: str
) -> None:
    """An outage leaves a backlog: a batch the relay claims must cost a few index probes per
    destination and per message it takes, not a read of every pending message (20,000 here,
    in three destinations, one of them backing off), or the relay slows down as the backlog
    grows, when it is needed most."""
    store = outbox_store(pg_pool)
    route = f"kafka:{uuid.uuid4().hex}"
    table = store.outbox.table
    await pg_pool.execute(
        f"INSERT INTO {table} (scope, unit_key, position, destination, body, idempotency_key,"
        " run, route, created_at) SELECT $1, 'k' || i, 0, $1 || '-d' || (i % 3), '\\x00', $1 || i,"
        " gen_random_uuid(), $2, now() - interval '1 hour' FROM generate_series(1, 20000) i",
        scope,
        route,
    )
    await pg_pool.execute(  # d0 backs off after a failed send
        f"UPDATE {table} SET due_at = now() + interval '1 hour', attempts = 1 WHERE id ="
        f" (SELECT min(id) FROM {table} WHERE scope = $1 AND destination = $1 || '-d0')",
        scope,
    )
    await pg_pool.execute(f"ANALYZE {table}")
    read: list[int] = []
    fetch = store.outbox._fetch

    async def explained(operation: str, scope_: str, conn: Any, sql: str, *args: Any) -> Any:
        if operation == "outbox_claim":
            plan = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
            read.append(_rows_read(json.loads(plan)[0]["Plan"]))
        return await fetch(operation, scope_, conn, sql, *args)

    store.outbox._fetch = explained  # type: ignore[method-assign]
    async with pg_pool.acquire() as conn, conn.transaction():
        claimed = await store.outbox.claim_due(conn, 200, None, route)  # OutboxService's
    assert len(claimed) == 200
    assert {m.destination for m in claimed} == {f"{scope}-d1", f"{scope}-d2"}  # d0 is held
    assert read and read[0] < 5 * 200, f"one batch of 200 read {read[0]} rows"
