"""Pruning a partitioned store (the README's way past one table: ``PARTITION BY HASH (scope,
key)``). A prune batch finds the rows it locked by their address, and a ctid repeats in every
partition: the address is the partition and the ctid, or a batch deletes (or soft-expires) the
live records at the same place in the other partitions, and their redeliveries run again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from consumer_idem import DecisionKind, PostgresStore, PrunePolicy
from tests._migrations import apply_by_hand

PARTITIONS = 4
TABLE_END = (
    "CHECK ((status = 'in_progress') = (owner_token IS NOT NULL AND locked_until IS NOT NULL))\n);"
)


@pytest.fixture
async def partitioned(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    """A store whose records table is hash-partitioned, the migrations otherwise as shipped."""
    schema = f"parted_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(pg_dsn)
    try:

        def partitioned_table(version: int, sql: str) -> str:
            if version != 1:
                return sql
            assert TABLE_END in sql
            parts = "".join(
                f"CREATE TABLE idempotency_records_p{i} PARTITION OF idempotency_records"
                f" FOR VALUES WITH (MODULUS {PARTITIONS}, REMAINDER {i});\n"
                for i in range(PARTITIONS)
            )
            return sql.replace(
                TABLE_END, TABLE_END[:-2] + ") PARTITION BY HASH (scope, key);\n" + parts
            )

        await apply_by_hand(conn, schema, rewrite=partitioned_table)
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
        assert pool is not None
        store = PostgresStore(pool, schema=schema, retention=3600)
        assert await store.migrate() == []
        yield store
        await pool.close()
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


@pytest.mark.parametrize("policy", [PrunePolicy.DELETE, PrunePolicy.SOFT])
async def test_a_prune_touches_only_expired_rows_in_every_partition(
    partitioned: PostgresStore, policy: PrunePolicy
) -> None:
    store = partitioned
    # expired records first, so they hold the first addresses of their partitions
    await store.pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, result_kind, completed_at,"
        " expires_at) SELECT 'pay', 'old-' || i, 'fp', 'completed', 'success', now(),"
        " now() - interval '1 minute' FROM generate_series(1, 8) i"
    )
    for i in range(40):  # live records at the same addresses of the other partitions
        done = await store.reserve("pay", f"done-{i}", "fp")
        assert done.token is not None
        await store.complete("pay", f"done-{i}", done.token, {"ok": i})
    rows = await store.pool.fetch(
        f"SELECT tableoid, ctid::text AS at, key FROM {store.table} ORDER BY key"
    )
    addresses = {r["at"] for r in rows if r["key"].startswith("old-")}
    assert any(r["at"] in addresses for r in rows if r["key"].startswith("done-"))
    report = await store.maintenance.prune(policy=policy)
    assert report.rows == 8 and report.finished
    after = dict(
        await store.pool.fetch(f"SELECT key, status FROM {store.table} WHERE key LIKE 'done-%'")
    )
    assert after == {f"done-{i}": "completed" for i in range(40)}
    for i in range(40):  # a redelivery replays: nothing runs twice
        assert (await store.reserve("pay", f"done-{i}", "fp")).kind is DecisionKind.REPLAY
