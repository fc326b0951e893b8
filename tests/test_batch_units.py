"""Batch mode: a batch commit PostgreSQL rolled back, order within a partition, the payload
each fallback attempt sees, a batch handler that ends the transaction, and work alongside a
batch's claim.

Each test names the mistake it exists to catch."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Action,
    ConsumerMessage,
    DecisionKind,
    PostgresStore,
    Retryable,
    Status,
    fingerprint_json,
    idempotent_consumer,
)
from tests import _core_units
from tests._core_units import FP, msg, rows

ledger = _core_units.ledger  # a fixture: the effect table


async def test_a_batch_whose_commit_rolled_back_is_never_acked(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    """A handler that swallows a database error without a savepoint aborts the transaction;
    COMMIT then answers ROLLBACK without raising. Acking that acks 0 records and 0 effects."""
    await pg_pool.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 0)", scope)

    @idempotent_consumer(store, scope=scope, batch=True, backoff=(0.01, 0.05))
    async def swallowing(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for m in messages:
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])
        # a unique violation, "handled" without a savepoint: the transaction is aborted
        with contextlib.suppress(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, 'taken', 1)", scope)

    verdicts = await swallowing.process_batch([msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)])
    assert all(v.action is not Action.ACK for v in verdicts)
    assert await rows(pg_pool, scope) == {"taken": 0}
    for i in range(3):  # nothing claims to be done
        record = await store.get(scope, f"k{i}")
        assert record is None or record.status is not Status.COMPLETED


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
                "INSERT INTO unit_ledger VALUES ($1, $2, $3)", scope, body["k"], body["amount"]
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
                "INSERT INTO unit_ledger VALUES ($1, $2, $3)", scope, body["k"], body["amount"]
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
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, key)

    batch = [msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)]
    first = await book.process_batch(batch)
    again = await book.process_batch(batch)
    assert calls == 1
    assert [v.action for v in first] == [Action.ACK] * 3 and all(v.reconcile for v in first)
    assert all(v.duplicate for v in again)
    for i in range(3):
        record = await store.get(scope, f"k{i}")
        assert record is not None and record.status is Status.UNKNOWN


async def test_a_batch_handler_that_rolls_back_and_begins_again_is_never_acked(
    store: PostgresStore, pg_pool: asyncpg.Pool, ledger: str, scope: str
) -> None:
    @idempotent_consumer(store, scope=scope, batch=True, max_attempts=2, backoff=(0.01, 0.05))
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await conn.execute("ROLLBACK; BEGIN")
        for m in messages:
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

    verdicts = await book.process_batch([msg(f"k{i}", {"k": f"k{i}"}) for i in range(3)])
    assert all(v.action is not Action.ACK for v in verdicts), verdicts
    assert await rows(pg_pool, scope) == {}


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
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

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
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])
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
            await conn.execute("INSERT INTO unit_ledger VALUES ($1, $2, 1)", scope, m.json()["k"])

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
