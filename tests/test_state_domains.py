"""A record's status and result kind are checked by their types (migration 12), not by CHECK
constraints of the table, which PostgreSQL prepares again for every statement that writes a
record: the same values are refused as before, and an upgrade neither rewrites nor loses
anything."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from consumer_idem import OutcomeKind, PostgresStore, run_transactional, run_two_phase
from tests._migrations import apply_by_hand

FP = "v1:jcs:domains"


@pytest.fixture
async def schema(pg_dsn: str) -> AsyncIterator[str]:
    name = f"domains_{uuid.uuid4().hex[:10]}"
    yield name
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        await conn.close()


async def insert(conn: asyncpg.Connection, table: str, key: str, status: str, kind: str) -> None:
    await conn.execute(
        f"INSERT INTO {table} (scope, key, fingerprint, status, result_kind, expires_at)"
        " VALUES ('s', $1, $2, $3, $4, now() + interval '1 day')",
        key,
        FP,
        status,
        kind,
    )


async def test_a_status_or_result_kind_outside_the_state_machine_is_refused(
    pg_dsn: str, schema: str
) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    assert pool is not None
    try:
        store = PostgresStore(pool, schema=schema)
        await store.migrate()
        async with pool.acquire() as conn:
            with pytest.raises(asyncpg.CheckViolationError, match="idempotency_status"):
                await insert(conn, store.table, "a", "done", "success")
            with pytest.raises(asyncpg.CheckViolationError, match="idempotency_result_kind"):
                await insert(conn, store.table, "b", "completed", "fine")
            await insert(conn, store.table, "c", "completed", "success")
            with pytest.raises(asyncpg.CheckViolationError, match="idempotency_status"):
                await conn.execute(f"UPDATE {store.table} SET status = 'gone' WHERE key = 'c'")
            # the owner and lease still go with in_progress alone (a table CHECK constraint)
            with pytest.raises(asyncpg.CheckViolationError, match="idempotency_records_check"):
                await insert(conn, store.table, "d", "in_progress", "success")
            checks = await conn.fetchval(
                "SELECT array_agg(conname::text ORDER BY conname) FROM pg_constraint"
                " WHERE conrelid = $1::regclass AND contype = 'c'",
                store.table,
            )
        assert checks == ["idempotency_records_check"]
    finally:
        await pool.close()


async def test_upgrading_a_version_11_store_keeps_every_record_without_a_rewrite(
    pg_dsn: str, schema: str
) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        await apply_by_hand(conn, schema, upto=11)  # the store as version 11 left it
        table = f'"{schema}".idempotency_records'
        for i, (status, kind) in enumerate(
            [("completed", "success"), ("completed", "domain_error"), ("unknown", None)]
        ):
            await insert(conn, table, f"old{i}", status, kind)  # type: ignore[arg-type]
        before = await conn.fetch(f"SELECT * FROM {table} ORDER BY key")
        node = await conn.fetchval("SELECT pg_relation_filenode($1::regclass)", table)
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
        assert pool is not None
        try:
            store = PostgresStore(pool, schema=schema)
            assert await store.migrate() == [12]
            # not rewritten: the same file holds the same rows
            assert await conn.fetchval("SELECT pg_relation_filenode($1::regclass)", table) == node
            assert [dict(r) for r in await conn.fetch(f"SELECT * FROM {table} ORDER BY key")] == [
                dict(r) for r in before
            ]
            with pytest.raises(asyncpg.CheckViolationError, match="idempotency_status"):
                await insert(conn, table, "new", "finished", "success")

            async def effect(c: asyncpg.Connection) -> dict[str, int]:
                return {"n": 1}

            async def work(attempt: object) -> str:
                return "done"

            first = await run_transactional(store, "s", "fresh", FP, effect)
            again = await run_transactional(store, "s", "fresh", FP, effect)
            assert first.kind == OutcomeKind.EXECUTED and again.kind == OutcomeKind.REPLAYED
            assert first.result == again.result == {"n": 1}
            assert (await run_two_phase(store, "s", "two", FP, work)).result == "done"
            record = await store.get("s", "old2")
            assert record is not None and record.status.value == "unknown"
        finally:
            await pool.close()
    finally:
        await conn.close()
