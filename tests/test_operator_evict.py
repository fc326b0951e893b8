"""An operator's `evict` keeps its promise: the key runs again, whatever state it was in.

A two-phase key parked ``unknown`` was acked once its original message was kept in the store;
a ``failed_retryable`` key resolved "not executed" waits on its armed original. In both the
record is all that stands for the work: evicting it must leave that original armed, so the
sweeper sends it again and the handler runs once, never delete it with the record.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from consumer_idem import (
    Action,
    Ambiguous,
    Attempt,
    ConsumerMessage,
    DecisionKind,
    KeyHeld,
    NotExecuted,
    PostgresStore,
    Status,
    header,
    idempotent_consumer,
)
from consumer_idem.notice import Notice, make_notice
from consumer_idem.transports.kafka import KafkaRunner
from tests._cli import cli
from tests._payments import send_raw, wait_until
from tests.test_consumer_kafka import FAST

FP = "v1:jcs:x"


@pytest.fixture(scope="module")
async def evicted_effects(pg_pool: asyncpg.Pool, store: PostgresStore) -> None:
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS evicted_effects (scope text, key text)")


async def charges(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM evicted_effects WHERE scope = $1", scope))


async def parked_unknown(
    store: PostgresStore,
    scope: str,
    body: bytes = b"{}",
    topic: str = "orders",
    why: str = "timeout",
) -> Notice:
    """Key ``k`` parked ``unknown``, and the notice (``why``) of its original message, ``body``
    on ``topic``, for the test to keep."""
    decision = await store.reserve(scope, "k", FP)
    await store.mark_unknown(scope, "k", decision.token, "timeout")
    original = ConsumerMessage(body, {"idempotency-key": b"k"}, topic=topic)
    return make_notice(scope, "k", why, source=topic, original=original)


async def test_evicting_an_unknown_key_whose_delivery_was_acked_runs_it_again(
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    evicted_effects: None,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    scope: str,
) -> None:
    topic = await kafka_topic_factory("evict")
    reconcile = await kafka_topic_factory("evict.rec")
    key = f"pay-{uuid.uuid4().hex[:6]}"
    calls = 0

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Ambiguous("gateway read timeout")  # parked unknown, its delivery acked
        await pg_pool.execute("INSERT INTO evicted_effects VALUES ($1, $2)", scope, key)
        return {"charged": key}

    runner = KafkaRunner(
        charge,
        topics=[topic],
        group_id=f"{topic}-g",
        reconcile_topic=reconcile,
        consumer_options=FAST,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await send_raw(kafka_producer, topic, [({"idempotency-key": key.encode()}, b'{"n": 1}')])

        async def parked_and_acked() -> bool:
            return runner.stats.processed >= 1

        await wait_until(parked_and_acked, 60, "the ambiguous delivery to be parked and acked")
        record = await store.get(scope, key)
        assert record is not None and record.status is Status.UNKNOWN
        assert await store.redispatch.kept_original(scope, key) is not None

        # the operator decides it did not take effect, and evicts it
        code, out, err = await cli("evict", scope, key, "--yes", "--json", dsn=pg_dsn)
        assert code == 0, err
        evicted = json.loads(out)
        assert evicted["evicted"] is True and evicted["status"] == "unknown"
        # the sweeper an operator runs sends the kept original again
        code, out, err = await cli(
            "sweep", "--transport", "kafka", "--scope", scope, "--json", dsn=pg_dsn
        )
        assert code == 0, err
        assert json.loads(out)["redispatched"] == 1, "the evicted key's work was lost"

        async def charged() -> bool:
            return await charges(pg_pool, scope) >= 1

        await wait_until(charged, 30, "the evicted key to run again")
        assert evicted["redispatch_to"] == topic
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert calls == 2 and await charges(pg_pool, scope) == 1
    record = await store.get(scope, key)
    assert record is not None and record.status is Status.COMPLETED
    assert await store.redispatch.kept_original(scope, key) is None  # sent and confirmed


async def test_evicting_a_key_resolved_not_executed_keeps_its_armed_original(
    store: PostgresStore, scope: str
) -> None:
    notice = await parked_unknown(store, scope, body=b'{"amount": 3}')
    assert await store.redispatch.keep_original(scope, "k", notice) is Status.UNKNOWN
    armed = await store.reconciliation.resolve_not_executed(
        scope, "k", NotExecuted("no charge"), due_in=3600
    )
    assert armed is not None  # due in an hour: not sent yet when the operator evicts

    eviction = await store.evict_record(scope, "k")
    assert eviction is not None and eviction.status is Status.FAILED_RETRYABLE
    assert eviction.redispatch_to == "orders"
    kept = await store.redispatch.kept_original(scope, "k")
    assert kept is not None and kept.armed and kept.notice.body == b'{"amount": 3}'


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.EXPIRED])
async def test_evicting_a_settled_key_drops_a_stale_outbox_row(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str, status: Status
) -> None:
    notice = await parked_unknown(store, scope)
    await store.redispatch.keep_original(scope, "k", notice)
    await pg_pool.execute(
        f"UPDATE {store.table} SET status = $3 WHERE scope = $1 AND key = $2",
        scope,
        "k",
        status.value,
    )
    eviction = await store.evict_record(scope, "k")
    assert eviction is not None and eviction.status is status and eviction.redispatch_to is None
    assert await store.redispatch.kept_original(scope, "k") is None
    assert await store.evict_record(scope, "k") is None


async def test_an_original_kept_while_an_operator_evicts_is_armed_not_orphaned(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    notice = await parked_unknown(store, scope, body=b'{"amount": 4}', why="met unknown")

    async def waiting() -> int:
        return int(
            await pg_pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
        )

    async def until_waiting(n: int) -> None:
        for _ in range(250):
            if await waiting() >= n:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"never {n} waiting on the row: nothing was raced")

    holder = await pg_pool.acquire()
    try:
        # a delivery keeps its original, and an operator evicts the key, both queued on the row
        await holder.execute("BEGIN")
        await holder.execute(
            f"SELECT 1 FROM {store.table} WHERE scope = $1 AND key = 'k' FOR UPDATE", scope
        )
        keeping = asyncio.create_task(store.redispatch.keep_original(scope, "k", notice))
        await until_waiting(1)
        evicting = asyncio.create_task(store.evict_record(scope, "k"))
        await until_waiting(2)
        await holder.execute("COMMIT")
        status = await asyncio.wait_for(keeping, 10)
        eviction = await asyncio.wait_for(evicting, 10)
    finally:
        await pg_pool.release(holder)
    assert status is Status.UNKNOWN  # kept first: its delivery is acked on that original
    assert eviction is not None and eviction.redispatch_to == "orders"
    kept = await store.redispatch.kept_original(scope, "k")
    assert kept is not None and kept.armed, "the kept original was orphaned: the work is lost"


async def test_the_cli_says_where_an_evicted_keys_original_goes(
    pg_dsn: str, store: PostgresStore, scope: str
) -> None:
    notice = await parked_unknown(store, scope, topic="orders.v2")
    await store.redispatch.keep_original(scope, "k", notice)
    code, out, err = await cli("evict", scope, "k", "--yes", dsn=pg_dsn)
    assert code == 0, err
    assert f"evicted ({scope}, k), was unknown" in out
    assert "sends it again to orders.v2" in out and "sweep --transport" in out


async def test_pruning_a_key_resolved_not_executed_keeps_its_armed_original(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    notice = await parked_unknown(store, scope)
    await store.redispatch.keep_original(scope, "k", notice)
    await store.reconciliation.resolve_not_executed(
        scope, "k", NotExecuted("no charge"), due_in=3600
    )
    await pg_pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = $1 AND key = 'k'",
        scope,
    )
    await store.maintenance.prune()
    assert await store.get(scope, "k") is None  # past retention: pruned
    kept = await store.redispatch.kept_original(scope, "k")
    assert kept is not None and kept.armed  # still sent by the sweeper: the work runs


async def test_a_key_a_worker_holds_is_not_evicted_under_its_running_call(
    pg_dsn: str, store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    held = await store.reserve(scope, "k", FP, lease=60)  # a two-phase call on the wire
    code, _, err = await cli("evict", scope, "k", "--yes", dsn=pg_dsn)
    assert code == 2 and "held by a worker until" in err and "nothing evicted" in err
    record = await store.get(scope, "k")
    assert record is not None and record.owner_token == held.token  # untouched
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.IN_PROGRESS
    # once its lease ran out the operator may decide: evicting then runs it again
    await pg_pool.execute(
        f"UPDATE {store.table} SET locked_until = now() - interval '1 s'"
        " WHERE scope = $1 AND key = 'k'",
        scope,
    )
    code, out, err = await cli("evict", scope, "k", "--yes", "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out)["status"] == "in_progress", err


async def test_store_evict_refuses_a_key_a_worker_holds_and_a_duplicate_does_not_charge_again(
    store: PostgresStore, scope: str
) -> None:
    """``store.evict(scope, key)`` is the operator's evict in code: it refuses a held key as the
    CLI does, so a duplicate delivered while the call is on the wire waits, and never runs the
    charge a second time."""
    charges = 0
    on_the_wire, answer = asyncio.Event(), asyncio.Event()

    @idempotent_consumer(store, scope=scope, mode="two_phase", key=header("idempotency-key"))
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal charges
        charges += 1
        on_the_wire.set()
        await answer.wait()
        return {"charged": True}

    def delivery() -> ConsumerMessage:
        return ConsumerMessage(b'{"n": 1}', {"idempotency-key": b"k"})

    first = asyncio.create_task(charge.process(delivery()))
    await asyncio.wait_for(on_the_wire.wait(), 10)
    with pytest.raises(KeyHeld) as refused:
        await store.evict(scope, "k")
    assert refused.value.held_until > datetime.now(UTC)
    duplicate = await charge.process(delivery())
    assert duplicate.reason == "in_progress"  # it waits for the worker, it does not run
    answer.set()
    done = await asyncio.wait_for(first, 10)
    assert done.action is Action.ACK and charges == 1
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.COMPLETED
    assert await store.evict(scope, "k") is True  # a settled key is evicted as before


async def test_evict_asks_on_stderr_so_its_json_answer_stays_parseable(
    pg_dsn: str, store: PostgresStore, scope: str
) -> None:
    """Without ``--yes`` the question goes to stderr: ``evict ... --json | jq`` shows it to the
    operator, and stdout holds the JSON answer alone."""
    done = await store.reserve(scope, "k", FP)
    await store.complete(scope, "k", done.token, {"ok": True})
    code, out, err = await cli("evict", scope, "k", "--json", dsn=pg_dsn, stdin=b"y\n")
    assert code == 0, err
    assert json.loads(out) == {
        "evicted": True,
        "scope": scope,
        "key": "k",
        "status": "completed",
        "redispatch_to": None,
    }
    assert f"Evict ({scope}, k)?" in err
    assert await store.get(scope, "k") is None
