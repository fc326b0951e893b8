"""The core's edges (issue 13): batch commits, batch order and fallback payloads, two-phase
fencing on every branch, deterministic failures, the reservation's conditional re-acquire.

Each test names the mistake it exists to catch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    Action,
    Attempt,
    CompletedCache,
    ConsumerMessage,
    DecisionKind,
    NotExecuted,
    OutcomeKind,
    PoisonMessage,
    PostgresStore,
    Retryable,
    Status,
    fingerprint_json,
    idempotent_consumer,
    run_transactional,
    run_two_phase,
)
from consumer_idem.commit import new_mark, savepoint
from consumer_idem.errors import SchemaMissing
from consumer_idem.notice import make_notice
from consumer_idem.stores.postgres.errors import is_database_outage, kind_of
from tests._racing import DuplicateOnRollback, insert_completed

FP = "v1:jcs:payload"


@pytest.fixture(scope="module")
async def ledger(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute(
        "CREATE TABLE IF NOT EXISTS edge_ledger (scope text, key text, amount int,"
        " PRIMARY KEY (scope, key))"
    )
    return "edge_ledger"


def msg(key: str, body: Any) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps(body).encode(), headers={"idempotency-key": key.encode()}
    )


async def rows(pool: asyncpg.Pool, scope: str) -> dict[str, int]:
    found = await pool.fetch("SELECT key, amount FROM edge_ledger WHERE scope = $1", scope)
    return {r["key"]: r["amount"] for r in found}


# --- a COMMIT that PostgreSQL answered with ROLLBACK ---------------------------------------------


async def test_a_batch_whose_commit_rolled_back_is_never_acked(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    """A handler that swallows a database error without a savepoint aborts the transaction;
    COMMIT then answers ROLLBACK without raising. Acking that acks 0 records and 0 effects."""
    await pg_pool.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 0)", scope)

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def swallowing(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])
        # a unique violation, "handled" without a savepoint: the transaction is aborted
        with contextlib.suppress(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 1)", scope)

    verdicts = await swallowing.process_batch([msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)])
    assert all(v.action is not Action.ACK for v in verdicts)
    assert await rows(pg_pool, scope) == {"taken": 0}
    for i in range(3):  # nothing claims to be done
        record = await store.get(scope, f"k{i}")
        assert record is None or record.status is not Status.COMPLETED


# --- batch mode: order within a partition, and what each attempt sees ---------------------------


async def test_batch_members_after_a_key_in_flight_elsewhere_wait_for_it(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    held = await store.reserve(scope, "b", FP.replace("payload", "held"), lease=30)
    assert held.kind is DecisionKind.EXECUTE
    # the held key's fingerprint must match the message's for in_progress (else misuse)
    body_b = {"k": "b", "amount": 2}
    await pg_pool.execute(
        f"UPDATE {store.table} SET fingerprint = $3 WHERE scope = $1 AND key = $2",
        scope,
        "b",
        fingerprint_json(body_b),
    )

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            body = m.json()
            await conn.execute(
                "INSERT INTO edge_ledger VALUES ($1, $2, $3)", scope, body["k"], body["amount"]
            )

    batch = [
        msg("a", {"k": "a", "amount": 1}),
        msg("b", body_b),
        msg("c", {"k": "c", "amount": 3}),
        msg("d", {"k": "d", "amount": 4}),
    ]
    verdicts = await book.process_batch(batch)
    assert [v.action for v in verdicts] == [Action.ACK, Action.RETRY]
    assert verdicts[1].reason == "in_progress"
    # c and d come after b in the partition: they must not have run ahead of it
    assert await rows(pg_pool, scope) == {"a": 1}
    assert await store.get(scope, "c") is None and await store.get(scope, "d") is None


async def test_batch_fallback_hands_each_attempt_the_original_payload(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    seen: list[int] = []

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            body = m.json()
            body["amount"] += 1000  # an in-place change, rolled back with the transaction
            seen.append(body["amount"])
            if body["k"] == "bad":
                raise Retryable("this member fails")
            await conn.execute(
                "INSERT INTO edge_ledger VALUES ($1, $2, $3)", scope, body["k"], body["amount"]
            )

    good = {"k": "good", "amount": 5}
    verdicts = await book.process_batch([msg("good", good), msg("bad", {"k": "bad", "amount": 7})])
    assert verdicts[0].action is Action.ACK
    # the one-by-one attempt after the failed batch saw 5 (+1000 once), never 1005 (+1000)
    assert seen[:3] == [1005, 1007, 1005], seen
    assert await rows(pg_pool, scope) == {"good": 1005}
    record = await store.get(scope, "good")
    assert record is not None and record.fingerprint == fingerprint_json(good)
    # a redelivery of the original bytes is a duplicate, not a key misuse
    again = await book.process_batch([msg("good", good)])
    assert again[0].action is Action.ACK and again[0].duplicate


# --- two-phase: every branch survives a lost lease ----------------------------------------------


async def test_two_phase_retryable_after_the_lease_was_lost_settles(
    store: PostgresStore, scope: str
) -> None:
    async def slow_then_refused(attempt: Attempt) -> Any:
        await asyncio.sleep(0.4)
        await store.maintenance.sweep()  # the lease expired meanwhile: the sweeper parks it
        raise Retryable("refused")

    outcome = await run_two_phase(store, scope, "k", FP, slow_then_refused, lease=0.2)
    assert outcome.kind is OutcomeKind.UNKNOWN  # what the record says now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN

    @idempotent_consumer(store, scope=scope, mode="two_phase", lease=0.2)
    async def handler(message: ConsumerMessage, attempt: Attempt) -> Any:
        await asyncio.sleep(0.4)
        await store.maintenance.sweep()
        raise Retryable("refused")

    verdict = await handler.process(msg("k2", {"n": 1}))
    assert verdict.action is Action.ACK and not verdict.reconcile  # the sweeper announced it


@pytest.mark.parametrize("error", [TimeoutError, ConnectionError, ConnectionResetError, OSError])
async def test_two_phase_builtin_io_errors_after_the_call_started_are_unknown(
    store: PostgresStore, scope: str, error: type[Exception]
) -> None:
    """A read timeout or a reset after the request went out may have charged: never retried."""

    async def call(attempt: Attempt) -> Any:
        raise error("after sending")

    outcome = await run_two_phase(store, scope, "k", FP, call)
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN
    assert (await store.reserve(scope, "k", FP)).kind is DecisionKind.UNKNOWN


async def test_two_phase_local_writes_that_swallow_an_error_do_not_complete(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 0)", scope)

    async def charge(attempt: Attempt) -> Any:
        return {"charged": True}

    async def local(conn: asyncpg.Connection, result: Any) -> None:
        with contextlib.suppress(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 1)", scope)

    outcome = await run_two_phase(store, scope, "k", FP, charge, local_writes=local)
    # the charge happened, its local record did not commit: parked, reconciled, never "done"
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN


# --- deterministic failures are not outages -----------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [{"name": "\ud800"}, {"blob": b"\x00"}, float("nan")],
    ids=["lone-surrogate", "bytes", "nan"],
)
async def test_a_result_that_cannot_be_stored_dead_letters_at_once_with_its_cause(
    store: PostgresStore, scope: str, result: Any
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, max_attempts=5)
    async def echo(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        return result

    verdict = await echo.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER, verdict
    assert verdict.reason == "unstorable_result"
    assert verdict.error is not None and "UnstorableResult" in verdict.error
    assert calls == 1  # not retried: it would fail the same way every time
    assert echo._store_failures == 0  # and never counted as an outage


async def test_a_missing_schema_fails_fast_and_names_the_fix(pg_pool: asyncpg.Pool) -> None:
    store = PostgresStore(pg_pool, schema="never_migrated")
    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await store.check_schema()

    @idempotent_consumer(store, scope="s")
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    with pytest.raises(SchemaMissing, match="consumer-idem migrate"):
        await handler.process(msg("k", {"n": 1}))


async def test_the_migrated_schema_passes_the_start_check(store: PostgresStore) -> None:
    await store.check_schema()


def test_only_outages_are_store_unavailable() -> None:
    from consumer_idem.errors import StoreRejected, StoreUnavailable

    assert kind_of(ConnectionRefusedError()) is StoreUnavailable
    assert kind_of(TimeoutError()) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.AdminShutdownError("bye")) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.SerializationError("retry")) is StoreUnavailable
    assert kind_of(asyncpg.exceptions.UndefinedTableError("no")) is SchemaMissing
    assert kind_of(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate")) is StoreRejected
    assert kind_of(asyncpg.exceptions.InvalidTextRepresentationError("bad")) is StoreRejected
    # a connection asyncpg took back after the server terminated it: an outage, not bad data
    released = asyncpg.InterfaceError(
        "cannot call Connection.execute(): connection has been released back to the pool"
    )
    assert kind_of(released) is StoreUnavailable


def test_a_sync_handler_is_refused_when_decorating(store: PostgresStore) -> None:
    def sync_handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    with pytest.raises(TypeError, match="async"):
        idempotent_consumer(store, scope="s")(sync_handler)


async def test_a_poison_message_is_logged_as_poison(
    store: PostgresStore, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    @idempotent_consumer(store, scope=scope)
    async def picky(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        raise PoisonMessage("amount_missing", "no amount")

    with caplog.at_level(logging.INFO, logger="consumer_idem"):
        verdict = await picky.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "amount_missing"
    assert any("poison" in r.getMessage() for r in caplog.records)
    assert not any("failed_retryable" in r.getMessage() for r in caplog.records)
    # the key stays free: a corrected copy (another payload, the same key) runs, no misuse
    assert await store.get(scope, "k") is None

    @idempotent_consumer(store, scope=scope)
    async def fixed(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    corrected = await fixed.process(msg("k", {"n": 1, "amount": 5}))
    assert corrected.action is Action.ACK and not corrected.duplicate


# --- the reservation: of several reservers queued on one row, exactly one executes -------------


async def test_reservers_queued_on_a_failed_retryable_row_yield_exactly_one_execute(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.fail_retryable(scope, "k", first.token)
    async with pg_pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(
            f"SELECT 1 FROM {store.table} WHERE scope = $1 AND key = $2 FOR UPDATE", scope, "k"
        )
        racers = [asyncio.create_task(store.reserve(scope, "k", FP)) for _ in range(6)]
        await asyncio.sleep(0.5)  # every racer is now queued on the row lock
        assert not any(t.done() for t in racers)
        await tx.rollback()
        decisions = await asyncio.gather(*racers)
    kinds = sorted(d.kind for d in decisions)
    assert kinds.count(DecisionKind.EXECUTE) == 1, kinds
    assert set(kinds) == {DecisionKind.EXECUTE, DecisionKind.IN_PROGRESS}


# --- the cache keeps completed records only -----------------------------------------------------


@pytest.fixture
async def cached(
    pg_pool: asyncpg.Pool, redis_client: aioredis.Redis, redis_prefix: str
) -> AsyncIterator[PostgresStore]:
    yield PostgresStore(pg_pool, cache=CompletedCache(redis_client, prefix=redis_prefix))


async def test_a_key_resolved_not_executed_through_a_cached_store_runs_again(
    cached: PostgresStore, scope: str
) -> None:
    first = await cached.reserve(scope, "k", FP)
    await cached.mark_unknown(scope, "k", first.token)
    resolved = await cached.resolve(scope, "k", NotExecuted("gateway has no such charge"))
    assert resolved.status is Status.FAILED_RETRYABLE
    assert (await cached.reserve(scope, "k", FP)).kind is DecisionKind.EXECUTE


# --- a handler that ends the library's transaction, waits on a lock, or is evicted mid-call ----


@pytest.mark.parametrize("ends_with", ["ROLLBACK", "COMMIT", "COMMIT; BEGIN"])
async def test_a_handler_that_ends_the_transaction_itself_never_runs_twice(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str, ends_with: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def recovering(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        await conn.execute(ends_with)  # "recovering" from an error, or committing early
        # from here on, autocommitted: durable whatever the library does next
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, f"e{calls}")
        return {"ok": True}

    verdicts = [await recovering.process(msg("k", {"n": 1})) for _ in range(3)]
    assert calls == 1, verdicts  # never run again: what it wrote may be durable
    assert all(v.action is Action.ACK for v in verdicts)
    record = await store.get(scope, "k")
    assert record is not None
    if ends_with == "ROLLBACK":  # its claim went with the rollback: parked for reconciliation
        assert record.status is Status.UNKNOWN and verdicts[0].reconcile
    else:  # its COMMIT committed the claim: that record is the truth
        assert record.status is Status.COMPLETED
    if ends_with == "COMMIT; BEGIN":  # what it wrote in the transaction it began is gone
        assert await rows(pg_pool, scope) == {}


@pytest.mark.parametrize("then", ["", "COMMIT; BEGIN"], ids=["plain", "handler_commits"])
async def test_a_connection_that_lost_the_commit_check_heals_and_never_misreports(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str, then: str
) -> None:
    """The COMMIT's transaction check is a statement prepared on the connection with the claim.
    Gone (a handler deallocated it), the unit's COMMIT is refused: nothing of it committed
    unless the work committed it itself, which is then found and reported as such (not as a
    failure to retry). The connection prepares it again: the next unit goes through."""

    def work(key: str, sql: str = "") -> Any:
        async def write(conn: asyncpg.Connection) -> None:
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, key)
            if sql:
                await conn.execute(sql)

        return write

    async with pg_pool.acquire() as conn:
        first = await run_transactional(store, scope, "k0", FP, work("k0"), conn=conn)
        assert first.kind is OutcomeKind.EXECUTED  # the statements are prepared on conn now
        await conn.execute(f"DEALLOCATE {store.fast_path._check_stmt}")
        lost = await run_transactional(store, scope, "k1", FP, work("k1", then), conn=conn)
        record = await store.get(scope, "k1")
        if then:  # the work's COMMIT committed its write and our completed claim
            assert lost.kind is OutcomeKind.REPLAYED
            assert record is not None and record.status is Status.COMPLETED
            assert await rows(pg_pool, scope) == {"k0": 1, "k1": 1}
        else:
            assert lost.kind is OutcomeKind.FAILED_RETRYABLE
            assert record is not None and record.status is Status.FAILED_RETRYABLE
            assert await rows(pg_pool, scope) == {"k0": 1}
        healed = await run_transactional(store, scope, "k2", FP, work("k2"), conn=conn)
        assert healed.kind is OutcomeKind.EXECUTED
        retried = await run_transactional(store, scope, "k1", FP, work("k1"), conn=conn)
        assert retried.kind is (OutcomeKind.REPLAYED if then else OutcomeKind.EXECUTED)
        assert await rows(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}


async def test_a_duplicate_with_another_payload_committing_after_the_work_rolled_back_is_misuse(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    """The handler ends the transaction itself (``ROLLBACK; BEGIN``): our claim row is gone.
    Right then a message with the same key and another payload claims and commits it. Our
    completed-looking row is not ours: the message is not acked as a replay of the other
    payload (that would lose it), it meets the key again and is dead-lettered as a misuse."""

    async def other_payload() -> None:
        async with pg_pool.acquire() as other, other.transaction():
            await insert_completed(other, store.table, scope, "k", "v1:other")

    duplicates = DuplicateOnRollback(pg_pool, other_payload)
    racing = PostgresStore(duplicates)  # type: ignore[arg-type]

    @idempotent_consumer(racing, scope=scope, backoff=(0.01, 0.05))
    async def recovers(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'k', 1)", scope)
        await conn.execute("ROLLBACK; BEGIN")  # "recovering" from an error: never do this
        duplicates.arm()

    first = await recovers.process(msg("k", {"n": 1}))
    assert duplicates.fired and not (first.action is Action.ACK and first.duplicate), first
    again = await recovers.process(msg("k", {"n": 1}))
    verdict = again if first.action is Action.RETRY else first
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "key_misuse", verdict
    assert await rows(pg_pool, scope) == {}


async def test_a_handler_that_commits_a_reacquired_claim_parks_it_at_once(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, backoff=(0.01, 0.05))
    async def flaky(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Retryable("first attempt fails: the key becomes failed_retryable")
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'before', 1)", scope)
        await conn.execute("COMMIT; BEGIN")  # the re-acquired lease is committed with it
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'after', 1)", scope)
        return {"ok": True}

    first = await flaky.process(msg("k", {"n": 1}))
    assert first.action is Action.RETRY
    second = await flaky.process(msg("k", {"n": 1}))
    third = await flaky.process(msg("k", {"n": 1}))
    assert calls == 2, (second, third)  # what it committed is durable: never run again
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN, record
    assert second.reconcile and second.action is Action.ACK
    assert await rows(pg_pool, scope) == {"before": 1}


async def test_a_lock_wait_in_the_handler_is_a_wait_not_a_handler_failure(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO edge_ledger VALUES ($1, 'hot', 0)", scope)

    @idempotent_consumer(store, scope=scope, max_attempts=1, backoff=(0.01, 0.05))
    async def bump(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("SET LOCAL lock_timeout = '100ms'")
        await conn.execute(
            "UPDATE edge_ledger SET amount = amount + 1 WHERE scope = $1 AND key = 'hot'", scope
        )

    async with pg_pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        await holder.execute(
            "SELECT 1 FROM edge_ledger WHERE scope = $1 AND key = 'hot' FOR UPDATE", scope
        )
        waiting = await bump.process(msg("k", {"n": 1}))
        await tx.rollback()
    # max_attempts=1: had it counted as a handler failure, it would be dead-lettered now
    assert waiting.action is Action.RETRY and waiting.reason == "store_unavailable", waiting
    done = await bump.process(msg("k", {"n": 1}))
    assert done.action is Action.ACK and not done.duplicate
    assert await rows(pg_pool, scope) == {"hot": 1}


async def test_a_two_phase_key_evicted_while_its_call_ran_is_never_run_again(
    store: PostgresStore, scope: str
) -> None:
    charges = 0

    @idempotent_consumer(store, scope=scope, mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        nonlocal charges
        charges += 1
        # forced under the running call (store.evict refuses a held key: KeyHeld)
        await store.evict_record(scope, "k", while_held=True)
        return {"charged": True}

    first = await charge.process(msg("k", {"n": 1}))
    again = await charge.process(msg("k", {"n": 1}))
    assert charges == 1
    assert first.action is Action.ACK and first.reconcile  # parked with a notice
    assert again.action is Action.ACK and again.duplicate
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN


async def test_a_batch_handler_that_ends_the_transaction_never_runs_twice(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute("ROLLBACK")
        for m in messages:  # autocommitted: durable whatever happens next
            key = f"{m.json()['k']}-{calls}"
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, key)

    batch = [msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)]
    first = await book.process_batch(batch)
    again = await book.process_batch(batch)
    assert calls == 1
    assert [v.action for v in first] == [Action.ACK] * 3 and all(v.reconcile for v in first)
    assert all(v.duplicate for v in again)
    for i in range(3):
        record = await store.get(scope, f"k{i}")
        assert record is not None and record.status is Status.UNKNOWN


async def test_a_body_nested_too_deeply_is_dead_lettered_not_a_crash(
    store: PostgresStore, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope)
    async def handler(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        return None

    deep = ConsumerMessage(body=b"[" * 100_000, headers={"idempotency-key": b"k"})
    verdict = await handler.process(deep)
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "invalid_json"


# --- the re-review: ROLLBACK; BEGIN, savepoints, evicted originals -----------------------------


async def test_a_handler_that_rolls_back_and_begins_again_commits_nothing_as_done(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    calls = 0

    @idempotent_consumer(store, scope=scope, max_attempts=3, backoff=(0.01, 0.05))
    async def recovering(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute("ROLLBACK; BEGIN")  # "recovering", in a transaction of its own
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, f"e{calls}")

    verdicts = [await recovering.process(msg("k", {"n": 1})) for _ in range(3)]
    # never acked as done: its claim was gone, so its writes were rolled back each time
    assert [v.action for v in verdicts] == [Action.RETRY, Action.RETRY, Action.DEAD_LETTER]
    assert verdicts[-1].error is not None and "ended the idempotency transaction" in (
        verdicts[-1].error
    )
    assert await rows(pg_pool, scope) == {}


def test_every_transaction_gets_a_mark_of_its_own() -> None:
    # a mark repeated on a connection would let a transaction the handler began pass the
    # check of an earlier one; and it is put into SQL text, so hex only
    marks = [new_mark() for _ in range(10_000)]
    assert len(set(marks)) == len(marks)
    assert all(m and set(m) <= set("0123456789abcdef") for m in marks)


async def test_a_batch_handler_that_rolls_back_and_begins_again_is_never_acked(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope, batch=True, max_attempts=2, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await conn.execute("ROLLBACK; BEGIN")
        for m in messages:
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

    verdicts = await book.process_batch([msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)])
    assert all(v.action is not Action.ACK for v in verdicts), verdicts
    assert await rows(pg_pool, scope) == {}


async def test_the_savepoint_helper_recovers_inside_the_transaction(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    await pg_pool.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 0)", scope)

    @idempotent_consumer(store, scope=scope)
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> str:
        try:
            async with savepoint(conn):
                await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'taken', 1)", scope)
        except asyncpg.UniqueViolationError:
            pass  # recovered: the transaction is still good
        await conn.execute("INSERT INTO edge_ledger VALUES ($1, 'booked', 1)", scope)
        return "ok"

    verdict = await book.process(msg("k", {"n": 1}))
    assert verdict.action is Action.ACK and not verdict.duplicate
    assert await rows(pg_pool, scope) == {"taken": 0, "booked": 1}


async def test_a_driver_misuse_in_a_handler_is_a_failure_not_an_outage(
    store: PostgresStore, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope, max_attempts=2, backoff=(0.01, 0.05))
    async def nested(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        async with conn.transaction():  # asyncpg refuses: the library opened the transaction
            pass

    first = await nested.process(msg("k", {"n": 1}))
    second = await nested.process(msg("k", {"n": 1}))
    assert first.reason == "failed_retryable" and second.action is Action.DEAD_LETTER
    # the handler's misuse is its own failure; the same from a statement of the library's
    # would be a bug of the deployed code, waited out rather than dead-lettering a backlog
    assert not is_database_outage(asyncpg.InterfaceError("the server expects 1 argument"))


async def test_a_key_parked_again_after_an_evict_redispatches_its_new_original(
    store: PostgresStore, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.mark_unknown(scope, "k", first.token)
    old = make_notice(scope, "k", "timeout", source="orders", original=msg("k", {"amount": 1}))
    assert await store.redispatch.keep_original(scope, "k", old) is Status.UNKNOWN
    # an operator evicts (the old original is armed), and the same key comes with another body
    await store.evict(scope, "k")
    second = await store.reserve(scope, "k", FP)
    await store.mark_unknown(scope, "k", second.token)
    new = make_notice(scope, "k", "timeout", source="orders", original=msg("k", {"amount": 2}))
    assert await store.redispatch.keep_original(scope, "k", new) is Status.UNKNOWN
    armed = await store.reconciliation.resolve_not_executed(
        scope, "k", NotExecuted("no charge"), due_in=0
    )
    assert armed is not None and json.loads(armed.notice.body or b"") == {"amount": 2}


async def test_a_two_phase_poison_message_is_dead_lettered_not_parked(
    store: PostgresStore, scope: str
) -> None:
    charged: list[int] = []

    @idempotent_consumer(store, scope=scope, mode="two_phase", backoff=(0.01, 0.05))
    async def charge(message: ConsumerMessage, attempt: Attempt) -> Any:
        amount = message.json().get("amount")
        if amount is None:  # refused before the gateway is called
            raise PoisonMessage("amount_missing", "no amount")
        charged.append(amount)
        return {"charged": amount}

    verdict = await charge.process(msg("k", {"n": 1}))
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "amount_missing", verdict
    assert not verdict.reconcile
    assert await store.get(scope, "k") is None  # the key is free again
    corrected = await charge.process(msg("k", {"amount": 5}))
    assert corrected.action is Action.ACK and charged == [5]
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.COMPLETED


# --- work alongside a batch's claim (process_batch(alongside=...)) -------------------------------


async def test_work_alongside_a_claim_runs_while_the_claim_is_in_postgres(
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    ledger: str,
    scope: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transport's own preparation runs while the claim's statement is in the server:
    not before it was sent (the process would sit idle for the claim's milliseconds after
    it), nor after its answer came back."""
    claim_many = store.fast_path.claim_many
    answered: list[bool] = []

    async def claim(*args: Any, **kwargs: Any) -> set[str]:
        claimed = await claim_many(*args, **kwargs)
        answered.append(True)
        return claimed

    monkeypatch.setattr(store.fast_path, "claim_many", claim)
    at_start: list[bool] = []
    seen: list[str] = []

    async def alongside() -> None:
        at_start.append(bool(answered))
        for _ in range(200):  # the server has the claim (running, or done and not yet read)
            query = await pg_pool.fetchval(
                "SELECT query FROM pg_stat_activity WHERE query LIKE '%unnest($2::text[]%'"
                " AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
            if query is not None:
                seen.append(query)
                return
            await asyncio.sleep(0.01)

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

    verdicts = await book.process_batch(
        [msg(f"k{i}", {"k": f"k{i}"}) for i in range(5)], alongside=alongside
    )
    assert [v.action for v in verdicts] == [Action.ACK] * 5
    assert at_start == [False], "the preparation ran after the claim's answer was read"
    assert seen, "the preparation ran before the claim was sent"
    assert answered == [True] and len(await rows(pg_pool, scope)) == 5


async def test_work_alongside_a_claim_that_fails_changes_nothing(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    async def alongside() -> None:
        raise RuntimeError("a decoder that fails")

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> list[Any]:
        for m in messages:
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])
        return [m.json()["k"] for m in messages]

    verdicts = await book.process_batch(
        [msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)], alongside=alongside
    )
    assert [v.action for v in verdicts] == [Action.ACK] * 3
    assert [v.result for v in verdicts] == ["k0", "k1", "k2"]
    assert await rows(pg_pool, scope) == {"k0": 1, "k1": 1, "k2": 1}


async def test_a_batch_cancelled_while_work_alongside_its_claim_runs_leaves_nothing_behind(
    pg_dsn: str, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    """Cancelled (a consumer stopping) while the preparation runs and the claim waits in the
    server: the claim is not left running on the connection (the pool gets it back usable)
    and no key stays claimed."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)  # one connection: reused
    assert pool is not None
    own = PostgresStore(pool)
    started = asyncio.Event()
    ran: list[str] = []

    async def alongside() -> None:
        started.set()
        await asyncio.Event().wait()  # until cancelled

    @idempotent_consumer(own, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            ran.append(m.json()["k"])
            await conn.execute("INSERT INTO edge_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

    batch = [msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)]
    backend = await pool.fetchval("SELECT pg_backend_pid()")
    async with pg_pool.acquire() as blocker:
        # another transaction's uncommitted claim of k0: this batch's claim waits in the server
        tx = blocker.transaction()
        await tx.start()
        await own.fast_path.claim_many(blocker, scope, ["k0"], [FP])
        task = asyncio.ensure_future(book.process_batch(batch, alongside=alongside))
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        await tx.rollback()
    try:
        # the same connection, not one the pool had to drop for a query still running on it
        assert await pool.fetchval("SELECT pg_backend_pid()") == backend
        assert ran == [] and await rows(pg_pool, scope) == {}
        for i in range(3):
            assert await own.get(scope, f"k{i}") is None  # the claim was rolled back
        again = await asyncio.wait_for(book.process_batch(batch), 10)
        assert [v.action for v in again] == [Action.ACK] * 3 and ran == ["k0", "k1", "k2"]
    finally:
        await pool.close()
