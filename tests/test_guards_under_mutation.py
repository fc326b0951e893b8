"""Behaviours a mutation round found no test guarding, each pinned here on the real PostgreSQL:
change the guard and the test named after its behaviour fails.

* the reconciler's "executed" with local writes: a COMMIT that PostgreSQL answers ``ROLLBACK``
  (the writes swallowed a failed statement) resolves nothing, and local writes that raise roll
  the resolution back (``operations/reconcile.py``);
* an ``expired`` (soft-pruned) row is re-claimed by one reserver only (``reserve()``);
* a webhook event id reused with another payload is refused (``webhooks.py``);
* ``keep_original`` holds the record's row while it keeps an original, so a concurrent "not
  executed" resolution cannot leave that original unarmed (``redispatch.py``);
* batch mode with offsets in Postgres stores no offset past a key repeated with another
  payload, which is still to be dead-lettered (``BatchUnit._settled_by_commit``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import (
    Action,
    ConsumerMessage,
    DecisionKind,
    Executed,
    NotExecuted,
    PostgresStore,
    Status,
    header,
    idempotent_consumer,
)
from consumer_idem.commit import rollback
from consumer_idem.notice import encode_notice, make_notice
from consumer_idem.operations.reconcile import Reconciler
from consumer_idem.transports.kafka_offsets import OffsetHook, PostgresOffsets
from consumer_idem.types import Record
from consumer_idem.webhooks import WebhookReceiver, sign_standard, standard_verifier

FP = "v1:jcs:x"
SECRET = "whsec_" + base64.b64encode(b"secret-for-the-mutation-guards-1").decode()


async def parked(store: PostgresStore, scope: str, key: str) -> None:
    decision = await store.reserve(scope, key, FP)
    await store.mark_unknown(scope, key, decision.token, "gateway timeout")


async def executed(record: Record) -> Executed:
    return Executed({"charge": "ch_1"})


def notice(scope: str, key: str) -> ConsumerMessage:
    return ConsumerMessage(encode_notice(scope, key, "gateway timeout"))


async def local_rows(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM guard_local WHERE scope = $1", scope))


LocalWrites = Callable[[asyncpg.Connection, Any], Awaitable[None]]


async def parked_with_writes(
    store: PostgresStore, pool: asyncpg.Pool, scope: str, first: LocalWrites
) -> LocalWrites:
    """Park key ``k`` unknown; the local writes returned run ``first`` on their first call, and
    on every later call write the charge's local row."""
    await pool.execute("CREATE TABLE IF NOT EXISTS guard_local (scope text, charge text)")
    await parked(store, scope, "k")
    calls = 0

    async def writes(conn: asyncpg.Connection, result: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await first(conn, result)
            return
        await conn.execute("INSERT INTO guard_local VALUES ($1, $2)", scope, result["charge"])

    return writes


# --- the reconciler's local writes --------------------------------------------------------------


async def test_local_writes_that_swallow_a_failed_statement_resolve_nothing(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def swallow_a_failed_statement(conn: asyncpg.Connection, result: Any) -> None:
        # a failed statement swallowed without a savepoint: the transaction is aborted
        with contextlib.suppress(asyncpg.DataError):
            await conn.execute("INSERT INTO guard_local VALUES ($1, 1/0)", scope)

    writes = await parked_with_writes(store, pg_pool, scope, swallow_a_failed_statement)
    reconciler = Reconciler(store, executed, scopes=[scope], local_writes={scope: writes})
    first = await reconciler.process(notice(scope, "k"))
    # PostgreSQL answered its COMMIT with ROLLBACK: nothing was resolved, the notice comes again
    assert first.action is Action.RETRY, first
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.UNKNOWN
    again = await reconciler.process(notice(scope, "k"))
    assert again.action is Action.ACK and again.reason == "executed"
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.COMPLETED
    assert await local_rows(pg_pool, scope) == 1


async def test_an_executed_answer_whose_local_writes_raise_is_not_committed(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    async def raise_a_bug(conn: asyncpg.Connection, result: Any) -> None:
        raise KeyError("receipt")  # a bug of the writes, no statement failed

    writes = await parked_with_writes(store, pg_pool, scope, raise_a_bug)
    reconciler = Reconciler(
        store, executed, scopes=[scope], local_writes={scope: writes}, backoff=(0.01, 0.05)
    )
    first = await reconciler.process(notice(scope, "k"))
    assert first.action is Action.ACK and first.reason == "rescheduled", first
    record = await store.get(scope, "k")
    # "completed" here would be a charge whose local rows are lost for good
    assert record is not None and record.status is Status.UNKNOWN
    assert record.last_error is not None and "local_writes failed" in record.last_error
    again = await reconciler.process(notice(scope, "k"))
    assert again.reason == "executed"
    assert await local_rows(pg_pool, scope) == 1


# --- re-claiming a soft-expired row -------------------------------------------------------------


async def test_queued_reservers_of_an_expired_row_get_one_execute(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    first = await store.reserve(scope, "k", FP)
    await store.complete(scope, "k", first.token, {"n": 1})
    await pg_pool.execute(
        f"UPDATE {store.table} SET status = 'expired' WHERE scope = $1 AND key = 'k'", scope
    )
    holder = await pg_pool.acquire()
    try:
        # hold the row: every reserver reads it expired, then queues on its row lock
        await holder.execute("BEGIN")
        await holder.execute(
            f"SELECT 1 FROM {store.table} WHERE scope = $1 AND key = 'k' FOR UPDATE", scope
        )
        reservers = [asyncio.create_task(store.reserve(scope, "k", FP)) for _ in range(5)]

        async def queued() -> int:
            return int(
                await pg_pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                )
            )

        for _ in range(200):  # until all five wait on the row (this test's database only)
            if await queued() >= 5:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the reservers never queued on the row: nothing was raced")
        await holder.execute("COMMIT")
        decisions = await asyncio.wait_for(asyncio.gather(*reservers), 30)
    finally:
        await rollback(holder)
        await pg_pool.release(holder)
    kinds = sorted(d.kind for d in decisions)
    assert kinds.count(DecisionKind.EXECUTE) == 1, kinds
    assert kinds.count(DecisionKind.IN_PROGRESS) == 4, kinds


# --- webhooks -----------------------------------------------------------------------------------


async def test_a_webhook_event_id_reused_with_another_payload_is_a_422(
    store: PostgresStore, scope: str
) -> None:
    processed: list[dict[str, Any]] = []

    async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
        processed.append(event)

    receiver = WebhookReceiver(store, scope, standard_verifier([SECRET]), on_event)
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    first = b'{"type": "charge.succeeded", "amount": 100}'
    other = b'{"type": "charge.refunded", "amount": 100}'
    now = int(time.time())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        one = await c.post("/hook", content=first, headers=sign_standard(first, SECRET, "m1", now))
        two = await c.post("/hook", content=other, headers=sign_standard(other, SECRET, "m1", now))
        same = await c.post("/hook", content=first, headers=sign_standard(first, SECRET, "m1", now))
    assert one.status_code == 200 and one.json()["duplicate"] is False
    assert two.status_code == 422, two.text  # never a silent 200 that drops the refund
    assert same.status_code == 200 and same.json()["duplicate"] is True
    assert [e["type"] for e in processed] == ["charge.succeeded"]


# --- keep_original against a "not executed" resolution ------------------------------------------


async def test_an_original_kept_during_a_not_executed_resolution_is_never_left_unarmed(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    await parked(store, scope, "k")
    original = ConsumerMessage(b'{"amount": 9}', {"idempotency-key": b"k"}, topic="orders")
    kept = make_notice(scope, "k", "duplicate met unknown", source="orders", original=original)
    resolver = await pg_pool.acquire()
    try:
        # the resolution has updated the record but not committed when the delivery keeps it
        await resolver.execute("BEGIN")
        await store.reconciliation.settle(scope, "k", NotExecuted("no charge"), conn=resolver)
        keeping = asyncio.create_task(store.redispatch.keep_original(scope, "k", kept))
        await asyncio.sleep(0.3)
        await resolver.execute("COMMIT")
        status = await asyncio.wait_for(keeping, 10)
    finally:
        await rollback(resolver)
        await pg_pool.release(resolver)
    row = await store.redispatch.kept_original(scope, "k")
    # either the resolution armed what was kept, or nothing was kept and the delivery is not
    # acked (it runs); an unarmed original beside a failed_retryable record is lost work
    assert row is None or row.armed, row
    assert status is not Status.UNKNOWN, "the delivery would be acked with its original unarmed"
    record = await store.get(scope, "k")
    assert record is not None and record.status is Status.FAILED_RETRYABLE


async def test_offsets_in_postgres_stop_before_a_repeated_key_with_another_payload(
    store: PostgresStore, pg_pool: asyncpg.Pool, scope: str
) -> None:
    """Batch mode, offsets kept in Postgres: a key repeated in one batch with another payload is
    dead-lettered after the COMMIT, so the offset that COMMIT stores must stop before it. Were it
    counted as settled, a crash before its dead letter is published would skip it for good."""
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS guard_batch (scope text, n int)")

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"), batch=True)
    async def book(batch: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        for message in batch:
            await conn.execute(
                "INSERT INTO guard_batch VALUES ($1, $2)", scope, message.json()["n"]
            )

    def record(offset: int, key: str, n: int) -> ConsumerMessage:
        return ConsumerMessage(
            json.dumps({"n": n}).encode(),
            {"idempotency-key": key.encode()},
            topic="payments",
            partition=0,
            offset=offset,
        )

    group = f"group-{scope}"
    hook = OffsetHook(PostgresOffsets(store, group), {})
    verdicts = await book.process_batch(
        [record(10, "a", 1), record(11, "b", 2), record(12, "a", 3)], hook
    )
    assert [v.action for v in verdicts] == [Action.ACK, Action.ACK, Action.DEAD_LETTER]
    assert verdicts[2].reason == "key_misuse"
    stored = await pg_pool.fetchval(
        f"SELECT next_offset FROM {store.schema}.kafka_offsets WHERE group_id = $1", group
    )
    assert stored == 12  # up to b; the misused repeat (12) is the runner's to settle
