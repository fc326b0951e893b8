"""The fault-injection matrix: every message path x every step boundary x every fault kind.

A fault fires once (the redelivery meets a healthy database, as after a blip); the message is
then delivered until settled, as a broker would. After each case the three invariants hold
(``consumer_idem.testing.check_invariants``): nothing acked without a durable effect, dead letter
or notice; the effect at most once; every message ends executed once, dead-lettered with a
reason, or ``unknown`` with a notice. No broker is needed: the faults are in PostgreSQL, and the
transport is played by ``consumer_idem.testing.deliver``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    Executed,
    IdempotentConsumer,
    NotExecuted,
    PoisonMessage,
    PostgresStore,
    Verdict,
    idempotent_consumer,
)
from consumer_idem.backoff import Backoff
from consumer_idem.consumer import Action
from consumer_idem.notice import encode_notice
from consumer_idem.operations.reconcile import Reconciler, StillUnknown, Sweeper
from consumer_idem.operations.replay import replay
from consumer_idem.testing import (
    Delivery,
    Fault,
    FaultyPool,
    Kind,
    MemoryTransport,
    Point,
    PublishFailed,
    PublishRefusedForGood,
    check_invariants,
    deliver,
    matrix,
)

KINDS = list(Kind)
LEASE = 0.3  # two-phase: a lost owner's record is parked soon after


@pytest.fixture(scope="module")
async def effects(pg_pool: asyncpg.Pool, store: PostgresStore) -> None:
    """The effect table, on the session database the ``store`` fixture migrated."""
    # no unique constraint: a doubled effect must show as two rows
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS fault_effects (scope text, key text)")


def message(key: str) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps({"key": key, "amount": 5}).encode(),
        headers={"idempotency-key": key.encode()},
    )


async def verify(pool: asyncpg.Pool, store: PostgresStore, delivery: Delivery, scope: str) -> None:
    key = delivery.message.json()["key"]
    effects = await pool.fetchval(
        "SELECT count(*) FROM fault_effects WHERE scope = $1 AND key = $2", scope, key
    )
    row = await pool.fetchrow(
        f"SELECT status, reconcile_after FROM {store.table} WHERE scope = $1 AND key = $2",
        scope,
        key,
    )
    check_invariants(
        delivery,
        effects=effects,
        status=None if row is None else row["status"],
        unknown_noticed=row is not None and row["reconcile_after"] is not None,
    )


def case_id(fault: Fault) -> str:
    return f"{fault.point}-{fault.kind}"


def transactional(store: PostgresStore, scope: str, result: bool = True) -> IdempotentConsumer:
    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05), max_attempts=50)
    async def book(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        key = msg.json()["key"]
        await conn.execute("INSERT INTO fault_effects VALUES ($1, $2)", scope, key)
        # with a result the fast path sends it with its COMMIT; without, a bare COMMIT
        return {"booked": key} if result else None

    return book


# --- transactional, a new key (the fast path) --------------------------------------------------


TX_NEW = matrix([Point.CLAIM, Point.HANDLER, Point.COMMIT], KINDS)


@pytest.mark.parametrize("result", [True, False], ids=["result", "no-result"])
@pytest.mark.parametrize("fault", TX_NEW, ids=case_id)
async def test_transactional_new_key(
    pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault, result: bool
) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    faulty.arm(fault)
    delivery = await deliver(transactional(store, scope, result).process, message("k"))
    assert faulty.log == [str(fault)], "the fault did not fire: the case tests nothing"
    await verify(pg_pool, store, delivery, scope)


# --- transactional, a run on one connection: the next claim rides with each COMMIT ----------


#: the second handler statement runs in a transaction begun with the first COMMIT; the second
#: COMMIT carries the third message's BEGIN and claim
TX_RUN = [Fault(f.point, f.kind, nth=2) for f in matrix([Point.HANDLER, Point.COMMIT], KINDS)]


@pytest.mark.parametrize("fault", TX_RUN, ids=case_id)
async def test_transactional_run(
    pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault
) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    faulty.arm(fault)
    book = transactional(store, scope)
    deliveries = await deliver_batch(book.process_batch, [message(f"k{i}") for i in range(3)])
    assert faulty.log == [str(fault)], "the fault did not fire: the case tests nothing"
    for delivery in deliveries:
        await verify(pg_pool, store, delivery, scope)


# --- transactional, a key re-acquired after a retryable failure (the reserve path) -----------


TX_AGAIN = matrix([Point.CLAIM, Point.HANDLER, Point.COMPLETE, Point.COMMIT], KINDS)


@pytest.mark.parametrize("fault", TX_AGAIN, ids=case_id)
async def test_transactional_reacquired_key(
    pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault
) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    first = await store.reserve(scope, "k", _fingerprint("k"))
    await store.fail_retryable(scope, "k", first.token, "earlier attempt refused")
    faulty.arm(fault)
    delivery = await deliver(transactional(store, scope).process, message("k"))
    assert faulty.log == [str(fault)]
    await verify(pg_pool, store, delivery, scope)


def _fingerprint(key: str) -> str:
    from consumer_idem import fingerprint_json

    return fingerprint_json({"key": key, "amount": 5})


# --- transactional, faults of the handler's own making ----------------------------------------


@pytest.mark.parametrize("result", [True, False], ids=["result", "no-result"])
@pytest.mark.parametrize("behaviour", ["raises", "ambiguous", "swallows_db_error", "cancelled"])
async def test_transactional_handler_faults(
    pg_pool: asyncpg.Pool, effects: None, scope: str, behaviour: str, result: bool
) -> None:
    store = PostgresStore(pg_pool)
    calls = 0

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05), max_attempts=50)
    async def book(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        key = msg.json()["key"]
        await conn.execute("INSERT INTO fault_effects VALUES ($1, $2)", scope, key)
        if calls == 1:  # the first attempt misbehaves, the redelivery is healthy
            if behaviour == "raises":
                raise RuntimeError("bug")
            if behaviour == "ambiguous":
                raise Ambiguous("may have happened")
            if behaviour == "swallows_db_error":
                with contextlib.suppress(asyncpg.DivisionByZeroError):
                    await conn.execute("SELECT 1/0")
            if behaviour == "cancelled":
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)
        return {"booked": key} if result else None

    delivery = await deliver(book.process, message("k"))
    await verify(pg_pool, store, delivery, scope)
    if behaviour != "ambiguous":  # it provably did not commit: it must have run again
        assert delivery.final is not None and delivery.final.action is Action.ACK
        assert not delivery.final.duplicate and calls == 2


async def test_transactional_crash_after_commit_before_ack(
    pg_pool: asyncpg.Pool, effects: None, scope: str
) -> None:
    store = PostgresStore(pg_pool)
    delivery = await deliver(transactional(store, scope).process, message("k"), crash_before_ack=2)
    await verify(pg_pool, store, delivery, scope)
    assert delivery.final is not None and delivery.final.duplicate  # the redelivery replayed


# --- two-phase (external effect, local writes committed with the completion) ------------------


def two_phase(store: PostgresStore, pool: asyncpg.Pool, scope: str, action: Any = None) -> Any:
    async def local(conn: asyncpg.Connection, result: Any) -> None:
        await conn.execute("SELECT 1")  # a local write's statement (a handler point)

    @idempotent_consumer(
        store,
        scope=scope,
        mode="two_phase",
        lease=LEASE,
        local_writes=local,
        backoff=(0.01, 0.05),
        max_attempts=50,
    )
    async def charge(msg: ConsumerMessage, attempt: Attempt) -> Any:
        key = msg.json()["key"]
        if action is not None:
            await action(attempt)
        # the external effect (a gateway call), on a connection the faults do not touch
        await pool.execute("INSERT INTO fault_effects VALUES ($1, $2)", scope, key)
        return {"charged": key}

    return charge


TWO_PHASE = matrix([Point.CLAIM, Point.HANDLER, Point.COMPLETE, Point.COMMIT], KINDS)


@pytest.mark.parametrize("fault", TWO_PHASE, ids=case_id)
async def test_two_phase(pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    faulty.arm(fault)
    sweeper = _sweeping(PostgresStore(pg_pool))
    try:
        delivery = await deliver(
            two_phase(store, pg_pool, scope).process, message("k"), max_deliveries=200
        )
    finally:
        sweeper.cancel()
    assert faulty.log == [str(fault)]
    await verify(pg_pool, store, delivery, scope)


def _sweeping(store: PostgresStore) -> asyncio.Task[None]:
    """The sweeper, as it runs beside consumers: expired leases become unknown."""

    async def sweep() -> None:
        while True:
            await store.maintenance.sweep()
            await asyncio.sleep(0.05)

    return asyncio.create_task(sweep())


@pytest.mark.parametrize("behaviour", ["lease_lost", "cancelled", "timeout_after_send"])
async def test_two_phase_action_faults(
    pg_pool: asyncpg.Pool, effects: None, scope: str, behaviour: str
) -> None:
    store = PostgresStore(pg_pool)

    async def misbehave(attempt: Attempt) -> None:
        if attempt.number > 1:
            return
        if behaviour == "lease_lost":
            await asyncio.sleep(LEASE * 2)  # the sweeper parks the record meanwhile
        elif behaviour == "cancelled":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        else:
            await pg_pool.execute("INSERT INTO fault_effects VALUES ($1, 'k')", scope)
            raise TimeoutError("read timeout after the request was sent")

    sweeper = _sweeping(store)
    try:
        delivery = await deliver(
            two_phase(store, pg_pool, scope, misbehave).process, message("k"), max_deliveries=200
        )
    finally:
        sweeper.cancel()
    await verify(pg_pool, store, delivery, scope)


# --- batch mode -------------------------------------------------------------------------------


async def deliver_batch(
    process: Callable[[Sequence[ConsumerMessage]], Awaitable[list[Verdict]]],
    messages: Sequence[ConsumerMessage],
    *,
    crash_before_ack: int = 0,
    max_rounds: int = 50,
) -> list[Delivery]:
    """A partition's worth of messages, redelivered from the first unsettled one."""
    deliveries = [Delivery(m) for m in messages]
    done = 0
    for _ in range(max_rounds):
        if done == len(messages):
            break
        pending = deliveries[done:]
        for d in pending:
            d.deliveries += 1
        try:
            verdicts = await process([d.message.fresh() for d in pending])
        except (Exception, asyncio.CancelledError):
            for d in pending:
                d.crashes += 1
            continue
        if crash_before_ack > 0:
            crash_before_ack -= 1
            continue
        for d, verdict in zip(pending, verdicts, strict=False):
            d.verdicts.append(verdict)
            if verdict.action is Action.RETRY:
                await asyncio.sleep(min(verdict.retry_after, 0.05))
                break
            d.acked = True
            if verdict.action is Action.DEAD_LETTER:
                d.dead_letter_reason = verdict.reason
            elif verdict.reconcile:
                d.notices += 1
            done += 1
    return deliveries


BATCH = matrix([Point.CLAIM, Point.HANDLER, Point.COMPLETE, Point.COMMIT], KINDS)


@pytest.mark.parametrize("fault", BATCH, ids=case_id)
async def test_batch(pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    # one key already failed_retryable: the batch completes it through the owner path
    first = await store.reserve(scope, "k1", _fingerprint("k1"))
    await store.fail_retryable(scope, "k1", first.token, "earlier attempt refused")

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05), max_attempts=50)
    async def book(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> list[Any]:
        keys = [m.json()["key"] for m in msgs]
        await conn.executemany(
            "INSERT INTO fault_effects VALUES ($1, $2)", [(scope, k) for k in keys]
        )
        return [{"booked": k} for k in keys]

    faulty.arm(fault)
    deliveries = await deliver_batch(book.process_batch, [message(f"k{i}") for i in range(3)])
    assert faulty.log == [str(fault)]
    for delivery in deliveries:
        await verify(pg_pool, store, delivery, scope)


async def test_batch_crash_after_commit_before_ack(
    pg_pool: asyncpg.Pool, effects: None, scope: str
) -> None:
    store = PostgresStore(pg_pool)

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await conn.executemany(
            "INSERT INTO fault_effects VALUES ($1, $2)", [(scope, m.json()["key"]) for m in msgs]
        )

    deliveries = await deliver_batch(
        book.process_batch, [message(f"k{i}") for i in range(3)], crash_before_ack=1
    )
    for delivery in deliveries:
        await verify(pg_pool, store, delivery, scope)
        assert delivery.final is not None and delivery.final.duplicate


def test_the_matrix_is_as_large_as_the_readme_says() -> None:
    """The README's testing section quotes these numbers: paths x step boundaries x faults."""
    sizes = {
        "transactional, new key (with and without a result)": 2 * len(TX_NEW),
        "transactional, a run (the next claim with each COMMIT)": len(TX_RUN),
        "transactional, re-acquired key": len(TX_AGAIN),
        "two-phase": len(TWO_PHASE),
        "batch": len(BATCH),
        "reconciler (x 3 resolver answers)": 3 * len(RECONCILE),
        "dead-letter replay": len(REPLAY),
        "FastStream (Kafka and RabbitMQ test brokers)": 2 * len(FASTSTREAM),
        "publishing (dead letter and notice x transient, permanent, permanent twice)": 6,
    }
    assert sizes == {
        "transactional, new key (with and without a result)": 26,
        "transactional, a run (the next claim with each COMMIT)": 9,
        "transactional, re-acquired key": 17,
        "two-phase": 17,
        "batch": 17,
        "reconciler (x 3 resolver answers)": 27,
        "dead-letter replay": 13,
        "FastStream (Kafka and RabbitMQ test brokers)": 26,
        "publishing (dead letter and notice x transient, permanent, permanent twice)": 6,
    }
    assert sum(sizes.values()) == 158


# --- publishing: dead letters and notices, transient and permanent failures --------------------


@pytest.fixture
def no_publish_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    import consumer_idem.transports.settle as settle_module

    monkeypatch.setattr(settle_module, "PUBLISH_BACKOFF", Backoff(0.0, 0.0))


PUBLISH_FAULTS = {
    "transient": [PublishFailed("timeout"), PublishFailed("leader moved"), None],
    "permanent": [PublishRefusedForGood("too large")],  # then the copy without the body
    "permanent_twice": [PublishRefusedForGood("too large"), PublishRefusedForGood("no topic")],
}


@pytest.mark.parametrize("faults", list(PUBLISH_FAULTS), ids=str)
@pytest.mark.parametrize("publish", ["dead_letter", "notice"])
async def test_publishing(
    pg_pool: asyncpg.Pool,
    effects: None,
    scope: str,
    no_publish_backoff: None,
    publish: str,
    faults: str,
) -> None:
    store = PostgresStore(pg_pool)

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def book(msg: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        if publish == "dead_letter":
            raise PoisonMessage("amount_missing")
        await conn.execute("INSERT INTO fault_effects VALUES ($1, 'k')", scope)
        raise Ambiguous("the far side may have it")

    transport = MemoryTransport(store, publish_faults=PUBLISH_FAULTS[faults])
    delivery = await deliver(book.process, message("k"), transport=transport)
    await verify(pg_pool, store, delivery, scope)
    published = [e for e in transport.events if e.startswith("published")]
    assert published and transport.events[-1].startswith("ack"), transport.events
    if publish == "dead_letter":
        assert delivery.dead_letter_reason == "amount_missing"
        assert delivery.body_dropped is (faults == "permanent")
    else:
        assert delivery.notices == 1


# --- the reconciler: resolving an unknown record, re-dispatching its message -------------------


RECONCILE = matrix([Point.COMPLETE, Point.COMMIT], KINDS)
ANSWERS = {
    "executed": Executed({"charged": True}),
    "not_executed": NotExecuted("the gateway has no such charge"),
    "still_unknown": StillUnknown("gateway down"),
}


async def parked(store: PostgresStore, scope: str) -> ConsumerMessage:
    """A key parked as unknown, and the notice its delivery published."""
    decision = await store.reserve(scope, "k", _fingerprint("k"))
    await store.mark_unknown(scope, "k", decision.token, "read timeout")
    notice = encode_notice(scope, "k", "read timeout", source="orders", original=message("k"))
    return ConsumerMessage(body=notice, headers={})


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("fault", RECONCILE, ids=case_id)
async def test_reconciler(
    pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault, answer: str
) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    notice = await parked(PostgresStore(pg_pool), scope)

    async def resolver(record: Any) -> Any:
        return ANSWERS[answer]

    reconciler = Reconciler(store, resolver, backoff=(0.01, 0.05), redispatch_grace=0.0)
    transport = MemoryTransport(store)
    reconciler.attach(transport)
    faulty.arm(fault)
    delivery = await deliver(reconciler.process, notice, transport=transport, max_deliveries=50)
    faulty.disarm()
    assert delivery.acked, delivery
    # what a crash may have left behind, the sweeper finishes
    await Sweeper(PostgresStore(pg_pool), transport).run_once()
    record = await PostgresStore(pg_pool).get(scope, "k")
    assert record is not None
    if answer == "executed" or record.status.value == "completed":
        assert record.status.value == "completed"
    elif answer == "not_executed":
        # the work is not lost: the row may run again and its message was re-sent
        assert record.status.value == "failed_retryable"
        assert [n.key for n in transport.redispatched][:1] == ["k"], transport.events
        pending = await PostgresStore(pg_pool).redispatch.pending_redispatches(10, [scope])
        assert pending == []
    else:
        assert record.status.value == "unknown" and record.reconcile_after is not None


@pytest.mark.parametrize("faults", ["transient", "permanent_twice"])
async def test_reconciler_redispatch_publish_faults(
    pg_pool: asyncpg.Pool, effects: None, scope: str, no_publish_backoff: None, faults: str
) -> None:
    store = PostgresStore(pg_pool)
    notice = await parked(store, scope)

    async def resolver(record: Any) -> Any:
        return NotExecuted("no such charge")

    reconciler = Reconciler(store, resolver, redispatch_grace=0.0)
    transport = MemoryTransport(store, publish_faults=PUBLISH_FAULTS[faults])
    reconciler.attach(transport)
    delivery = await deliver(reconciler.process, notice, transport=transport)
    assert delivery.acked
    for _ in range(5):  # the sweeper re-sends whatever the reconciler could not
        if transport.redispatched:
            break
        await pg_pool.execute(
            "UPDATE consumer_idem.redispatch_outbox SET due_at = now() WHERE scope = $1", scope
        )
        await Sweeper(store, transport).run_once()
    assert [n.key for n in transport.redispatched] == ["k"], transport.events
    record = await store.get(scope, "k")
    assert record is not None and record.status.value == "failed_retryable"


# --- dead-letter replay: the same consumer, fed from a dead-letter source ---------------------


REPLAY = matrix([Point.CLAIM, Point.HANDLER, Point.COMMIT], KINDS)


@pytest.mark.parametrize("fault", REPLAY, ids=case_id)
async def test_replay(pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    consumer = transactional(store, scope)
    faulty.arm(fault)
    kept: list[ConsumerMessage] = [message("k")]  # the dead-letter queue
    acked: list[bool] = []
    for _ in range(20):  # a resumable replay runs again until the queue is empty
        if not kept:
            break

        async def source() -> Any:
            item = kept.pop(0)

            async def ack(settled: bool, verdict: Any = None) -> None:
                acked.append(settled)
                if not settled:
                    kept.append(item)

            yield item.fresh(), ack

        try:
            await replay(consumer, source())
        except (Exception, asyncio.CancelledError):
            kept.append(message("k"))  # the replay died: the message is still in the queue
    assert not kept and acked[-1] is True
    assert faulty.log == [str(fault)]
    effects_now = await pg_pool.fetchval(
        "SELECT count(*) FROM fault_effects WHERE scope = $1", scope
    )
    record = await PostgresStore(pg_pool).get(scope, "k")
    assert effects_now == 1 and record is not None and record.status.value == "completed"


# --- FastStream: the middleware over FastStream's test brokers ----------------------------------


FASTSTREAM = matrix([Point.CLAIM, Point.HANDLER, Point.COMMIT], KINDS)


@pytest.mark.parametrize("transport", ["kafka", "rabbit"])
@pytest.mark.parametrize("fault", FASTSTREAM, ids=case_id)
async def test_faststream(
    pg_pool: asyncpg.Pool, effects: None, scope: str, fault: Fault, transport: str
) -> None:
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
    from faststream.rabbit import RabbitBroker, RabbitRouter, TestRabbitBroker

    from consumer_idem import header
    from consumer_idem.faststream import Idempotency, IdempotentConnection

    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    broker: Any
    if transport == "kafka":
        broker, router_type, test_broker = KafkaBroker(), KafkaRouter, TestKafkaBroker
        options: dict[str, Any] = {"group_id": "g", "ack_policy": AckPolicy.MANUAL}
    else:
        broker, router_type, test_broker = RabbitBroker(), RabbitRouter, TestRabbitBroker
        options = {"ack_policy": AckPolicy.MANUAL}
    idem = Idempotency(
        store, broker=broker, scope=scope, key=header("idempotency-key"), backoff=(0.01, 0.05)
    )
    router = router_type(middlewares=[idem])
    published: list[Any] = []

    @router.subscriber("in", **options)
    @router.publisher("out")
    async def book(data: dict[str, Any], conn: IdempotentConnection) -> dict[str, Any]:
        await conn.execute("INSERT INTO fault_effects VALUES ($1, $2)", scope, data["key"])
        return {"booked": data["key"]}

    @broker.subscriber("out")
    async def collect(data: dict[str, Any]) -> None:
        published.append(data)

    broker.include_router(router)
    faulty.arm(fault)
    async with test_broker(broker):
        for _ in range(10):  # the test broker does not redeliver: the producer sends it again
            send = asyncio.create_task(
                broker.publish({"key": "k", "amount": 5}, "in", headers={"idempotency-key": "k"})
            )
            # a delivery that failed in the consumer: the redelivery comes next
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await send
            record = await PostgresStore(pg_pool).get(scope, "k")
            if record is not None and record.status.value == "completed" and published:
                break
    assert faulty.log == [str(fault)]
    effects_now = await pg_pool.fetchval(
        "SELECT count(*) FROM fault_effects WHERE scope = $1", scope
    )
    record = await PostgresStore(pg_pool).get(scope, "k")
    assert effects_now == 1 and record is not None and record.status.value == "completed"
    assert published and all(p == {"booked": "k"} for p in published)  # replays publish the same


async def test_the_readme_example(pg_pool: asyncpg.Pool, effects: None, scope: str) -> None:
    faulty = FaultyPool(pg_pool)
    store = PostgresStore(faulty)
    consumer = transactional(store, scope)
    faulty.arm(Fault(Point.COMMIT, Kind.DROP_AFTER))  # the COMMIT lands; the client never hears
    delivery = await deliver(consumer.process, message("k"))
    assert delivery.acked and delivery.final is not None and delivery.final.duplicate
