"""A key parked ``unknown`` never loses its work, whichever delivery of it was acked.

A delivery whose outcome is ``unknown`` (it parked the key, or met it parked) is acked only once
its original message is kept in the store (an unarmed row of the re-dispatch outbox). "Not
executed" arms it in the resolution's transaction, whether or not the notice carried a body,
so the work runs once; "executed" deletes it. The ways a key gets parked without a notice that
carries its original: a cancelled two-phase call (parks, then re-raises), a worker killed
mid-call (the sweeper parks its lease), a dead-letter replay that ends ``unknown``; each time the
next delivery meets ``unknown`` and is acked.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from consumer_idem import (
    Action,
    Ambiguous,
    Attempt,
    ConsumerMessage,
    Executed,
    NotExecuted,
    PostgresStore,
    Status,
    StoreUnavailable,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.notice import encode_notice
from consumer_idem.operations.reconcile import Reconciler, Sweeper
from consumer_idem.operations.replay import kafka_source, replay
from consumer_idem.testing import Delivery, MemoryTransport, deliver
from consumer_idem.transports.kafka import KafkaRunner
from consumer_idem.transports.settle import Settled, settle
from consumer_idem.types import Record
from tests._payments import read_topic, send_raw, wait_until
from tests._runners import Running
from tests.test_consumer_kafka import FAST, committed


@pytest.fixture(scope="module")
async def effects_table(pg_pool: asyncpg.Pool, store: PostgresStore) -> None:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS kept_effects (scope text, key text)")


async def effects(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM kept_effects WHERE scope = $1", scope))


async def no_charge(record: Record) -> Any:
    return NotExecuted("gateway: no charge for that key")


def bare_notice(scope: str, key: str) -> ConsumerMessage:
    """The notice the sweeper publishes for a due ``unknown`` row: no original message."""
    return ConsumerMessage(encode_notice(scope, key, "lease_expired"))


# --- without a broker: each way to park, then "not executed" -----------------------------------


@pytest.mark.parametrize("parked_by", ["cancelled", "swept_lease", "ambiguous_then_bare_notice"])
async def test_not_executed_runs_the_work_acked_as_a_duplicate_of_unknown(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects_table: None, scope: str, parked_by: str
) -> None:
    key = f"pay-{uuid.uuid4().hex[:6]}"
    calls = 0

    @idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), mode="two_phase", lease=0.2
    )
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1 and parked_by == "cancelled":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # a shutdown during the gateway call: parked, then re-raised
            await asyncio.sleep(0)
        if calls == 1 and parked_by == "ambiguous_then_bare_notice":
            raise Ambiguous("read timeout")
        await pg_pool.execute("INSERT INTO kept_effects VALUES ($1, $2)", scope, key)
        return {"charged": key}

    message = ConsumerMessage(b'{"amount": 7}', {"idempotency-key": key.encode()})
    transport = MemoryTransport(store)
    if parked_by == "swept_lease":  # a worker took the key and was killed mid-call
        await store.reserve(scope, key, charge.prepare(message)[1], lease=0.05)  # type: ignore[index]
        await asyncio.sleep(0.2)
        assert (await store.maintenance.sweep()).parked >= 1
    if parked_by == "ambiguous_then_bare_notice":
        first = await deliver(charge.process, message, transport=transport)
        assert first.notices == 1
    # the next delivery (a redelivery after the crash, or the producer's retry) meets unknown
    duplicate = await deliver(charge.process, message, transport=transport)
    assert duplicate.acked and duplicate.final is not None and duplicate.final.duplicate
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.UNKNOWN

    reconciler = Reconciler(store, no_charge, scopes=[scope], redispatch_grace=0)
    reconciler.attach(transport)
    verdict = await reconciler.process(bare_notice(scope, key))
    assert verdict.action is Action.ACK and verdict.reason == "not_executed"
    assert transport.redispatched, "nothing re-dispatched: the work is lost"
    sent = transport.redispatched[-1]
    assert sent.body == message.body and sent.headers == dict(message.headers)
    assert await store.redispatch.kept_original(scope, key) is None  # sent and confirmed: gone

    assert sent.body is not None
    ran = await deliver(charge.process, ConsumerMessage(sent.body, sent.headers))
    assert ran.acked and ran.final is not None and not ran.final.duplicate
    assert await effects(pg_pool, scope) == 1
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.COMPLETED


async def test_an_unknown_outcome_is_not_acked_while_its_original_cannot_be_kept(
    store: PostgresStore, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raise Ambiguous("read timeout")

    message = ConsumerMessage(b'{"amount": 7}', {"idempotency-key": b"pay-down"})
    verdict = await charge.process(message)
    assert verdict.reconcile

    async def down(*args: Any) -> Any:
        raise StoreUnavailable("injected: the database went away")

    monkeypatch.setattr(store.redispatch, "keep_original", down)
    transport = MemoryTransport(store)
    delivery = Delivery(message, verdicts=[verdict])
    assert await settle(transport, delivery, verdict) is Settled.RETRY
    assert not delivery.acked and delivery.notices == 0
    monkeypatch.undo()
    # it comes again, meets the key unknown, and is kept and acked this time
    again = await deliver(charge.process, message, transport=transport)
    assert again.acked
    kept = await store.redispatch.kept_original(scope, "pay-down")
    assert kept is not None and not kept.armed and kept.notice.body == message.body


async def test_a_delivery_is_not_acked_when_the_key_was_resolved_not_executed_meanwhile(
    store: PostgresStore, pg_pool: asyncpg.Pool, effects_table: None, scope: str
) -> None:
    """The race: a delivery meets ``unknown``; before it is acked, the reconciler resolves the
    record "not executed" (nothing kept yet, so nothing to re-dispatch). Acking it now would
    lose the work: it must run."""
    calls = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Ambiguous("read timeout")
        await pg_pool.execute("INSERT INTO kept_effects VALUES ($1, 'pay-race')", scope)
        return {}

    message = ConsumerMessage(b'{"amount": 7}', {"idempotency-key": b"pay-race"})
    await charge.process(message)  # parked; say its notice and kept original were lost
    met = await charge.process(message)
    assert met.duplicate and met.outcome is not None
    await store.resolve(scope, "pay-race", NotExecuted("no charge"))  # nothing kept: plain
    transport = MemoryTransport(store)
    delivery = Delivery(message, verdicts=[met])
    assert await settle(transport, delivery, met) is Settled.RETRY
    assert not delivery.acked
    again = await deliver(charge.process, message, transport=transport)  # the redelivery
    assert again.acked and again.final is not None and not again.final.duplicate
    assert await effects(pg_pool, scope) == 1


async def test_any_resolution_settles_the_kept_original(store: PostgresStore, scope: str) -> None:
    """Resolving by hand or from a webhook (``store.resolve``) arms the kept original (the
    sweeper sends it) or deletes it, like the reconciler."""

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raise Ambiguous("read timeout")

    transport = MemoryTransport(store)
    for key in ("pay-no", "pay-yes"):
        message = ConsumerMessage(b"{}", {"idempotency-key": key.encode()})
        assert (await deliver(charge.process, message, transport=transport)).acked
        kept = await store.redispatch.kept_original(scope, key)
        assert kept is not None and not kept.armed
    assert await store.redispatch.pending_redispatches(scopes=[scope], due_only=False) == []
    await store.resolve(scope, "pay-no", NotExecuted("no charge"))
    await store.resolve(scope, "pay-yes", Executed({"charge": "ch_1"}))
    assert await store.redispatch.kept_original(scope, "pay-yes") is None
    report = await Sweeper(store, transport, scopes=[scope]).run_once()
    assert report.redispatched == 1
    assert [n.key for n in transport.redispatched] == ["pay-no"]
    assert await store.redispatch.kept_original(scope, "pay-no") is None


async def test_an_armed_original_is_disarmed_when_its_key_is_parked_again(
    store: PostgresStore, scope: str
) -> None:
    """A re-dispatch armed but not confirmed yet, while another delivery of the key runs and
    parks it again: the original is kept (disarmed, renumbered), and the pending send's
    confirmation does not delete it."""
    from consumer_idem.notice import make_notice

    original = ConsumerMessage(b"{}", {"idempotency-key": b"pay-again"})
    notice = make_notice(scope, "pay-again", "timeout", source="payments", original=original)
    first = await store.reserve(scope, "pay-again", "v1:fp")
    await store.mark_unknown(scope, "pay-again", first.token, "timeout")
    assert await store.redispatch.keep_original(scope, "pay-again", notice) is Status.UNKNOWN
    armed = await store.reconciliation.resolve_not_executed(
        scope, "pay-again", NotExecuted("no"), due_in=0
    )
    assert armed is not None and armed.armed
    again = await store.reserve(scope, "pay-again", "v1:fp")  # the producer's retry runs it
    await store.mark_unknown(scope, "pay-again", again.token, "timeout again")
    assert await store.redispatch.keep_original(scope, "pay-again", notice) is Status.UNKNOWN
    await store.redispatch.redispatch_done(armed.id)  # the earlier send, confirmed late
    kept = await store.redispatch.kept_original(scope, "pay-again")
    assert kept is not None and not kept.armed and kept.id != armed.id
    assert await store.redispatch.pending_redispatches(scopes=[scope], due_only=False) == []
    assert await store.redispatch.redispatch_count(scope, "pay-again") == 1


def test_a_dead_letter_copy_is_kept_for_the_topic_or_queue_it_came_from() -> None:
    from consumer_idem.operations.replay import dead_letter_original

    kafka_copy = ConsumerMessage(
        b"{}",
        {
            "idempotency-key": b"k",
            "x-original-topic": b"orders",
            "x-original-partition": b"2",
            "x-original-offset": b"9",
            "x-dead-letter-reason": b"max_attempts_exceeded",
            "x-dead-letter-error": b"boom",
        },
        topic="orders.dlq",
        partition=0,
        offset=3,
        record_key=b"customer-1",
    )
    notice = dead_letter_original("s", "k", None, kafka_copy)
    assert notice.source == "orders" and notice.record_key == b"customer-1"
    assert notice.headers == {
        "idempotency-key": b"k",
        "x-original-topic": b"orders",
        "x-original-partition": b"2",
        "x-original-offset": b"9",
    }
    rabbit_copy = ConsumerMessage(
        b"{}",
        {"x-original-queue": b"payments", "x-dead-letter-reason": b"poison"},
        message_id="order-1",
    )
    notice = dead_letter_original("s", "order-1", None, rabbit_copy)
    assert notice.source == "payments" and notice.properties == {"message_id": "order-1"}
    assert notice.headers == {"x-original-queue": b"payments"}


# --- on the real broker -------------------------------------------------------------------------


async def test_kafka_a_handler_cancelled_by_a_stop_runs_once_after_not_executed(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    effects_table: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("kept")
    reconcile = await kafka_topic_factory("kept.rec")
    group = f"{topic}-g"
    calls = 0

    @idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), mode="two_phase", lease=5
    )
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(30)  # the gateway call, cancelled by the stop below
        await pg_pool.execute("INSERT INTO kept_effects VALUES ($1, 'pay-1')", scope)
        return {"charged": True}

    await send_raw(kafka_producer, topic, [({"idempotency-key": b"pay-1"}, b'{"amount": 100}')])
    first = KafkaRunner(
        charge,
        topics=[topic],
        group_id=group,
        reconcile_topic=reconcile,
        revoke_timeout=1.0,
        consumer_options=FAST,
    )
    running = Running()
    running.start(first)

    async def started() -> bool:
        return calls >= 1

    await wait_until(started, 30, "the handler to start")
    await running.stop_all()  # drain timeout: the handler is cancelled, the key parked
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.UNKNOWN
    assert await committed(settings, group, topic) is None

    redelivery = Running()
    second = redelivery.start(
        KafkaRunner(
            charge, topics=[topic], group_id=group, reconcile_topic=reconcile, consumer_options=FAST
        )
    )

    async def acked_as_duplicate() -> bool:
        return second.stats.duplicates >= 1

    # the redelivery meets the key unknown and is acked (its offset committed)
    await wait_until(acked_as_duplicate, 60, "the redelivery to be acked as a duplicate")
    await redelivery.stop_all()  # it commits as it stops; a new runner takes over
    assert await committed(settings, group, topic) == 1
    third = running.start(
        KafkaRunner(
            charge, topics=[topic], group_id=group, reconcile_topic=reconcile, consumer_options=FAST
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
    sweeping = asyncio.Event()
    sweeper = asyncio.create_task(
        Sweeper(store, rec_runner, scopes=[scope]).run(sweeping, interval=0.3)
    )
    try:

        async def charged() -> bool:
            return await effects(pg_pool, scope) >= 1

        await wait_until(charged, 60, "the payment resolved 'not executed' to run")
        await asyncio.sleep(1.0)
    finally:
        sweeping.set()
        await sweeper
        await running.stop_all()
    assert await effects(pg_pool, scope) == 1
    assert third.stats.executed == 1  # the re-dispatched copy
    record = await store.get(scope, "pay-1")
    assert record is not None and record.status is Status.COMPLETED
    # the original and its re-dispatch (the sweeper, due at once here, may send a second copy:
    # it replays)
    assert (await committed(settings, group, topic) or 0) >= 2


async def test_kafka_replay_of_an_ambiguous_copy_redispatches_it_to_its_original_topic(
    settings: Settings,
    store: PostgresStore,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    scope: str,
) -> None:
    origin = await kafka_topic_factory("orig")
    dlq = await kafka_topic_factory("orig.dlq")

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        raise Ambiguous("connect timeout")

    await kafka_producer.send_and_wait(
        dlq,
        value=b'{"amount": 7}',
        key=b"customer-9",
        headers=[
            ("idempotency-key", b"pay-9"),
            ("x-original-topic", origin.encode()),
            ("x-original-partition", b"0"),
            ("x-original-offset", b"17"),
            ("x-dead-letter-reason", b"max_attempts_exceeded"),
            ("x-dead-letter-scope", scope.encode()),
        ],
    )
    report = await replay(
        charge,
        kafka_source(dlq, group_id=f"{dlq}-r", bootstrap_servers=settings.kafka_bootstrap),
    )
    assert report.unknown == 1

    publisher = KafkaRunner(charge, topics=[origin], group_id=f"{origin}-pub")
    await publisher.open_publisher()
    try:
        reconciler = Reconciler(store, no_charge, scopes=[scope], redispatch_grace=0)
        reconciler.attach(publisher)
        verdict = await reconciler.process(bare_notice(scope, "pay-9"))
    finally:
        await publisher.close_publisher()
    assert verdict.reason == "not_executed"
    (copy,) = await read_topic(settings.kafka_bootstrap, origin, 1)
    assert copy.value == b'{"amount": 7}' and copy.key == b"customer-9"
    headers = dict(copy.headers)
    assert headers["idempotency-key"] == b"pay-9"
    assert headers["x-original-topic"] == origin.encode()
    assert headers["x-original-offset"] == b"17"
    assert not any(name.startswith("x-dead-letter") for name in headers)
