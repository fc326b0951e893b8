"""The library's per-store identifiers (prepared statements, the NOTIFY channel) stay distinct
and whole for every valid schema name, up to 63 characters: PostgreSQL cuts an identifier at
63 bytes without a word, so a name built as ``prefix_schema`` could be cut into another
store's, or into a name the library then cannot find again."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    idempotent_consumer,
    run_transactional,
)
from consumer_idem.consumer import Action
from consumer_idem.stores.postgres.migrate import per_schema_name, validate_schema

FP = "v1:jcs:schema-names"


async def migrated(pool: asyncpg.Pool, schema: str) -> PostgresStore:
    store = PostgresStore(pool, schema=validate_schema(schema))
    await store.migrate()
    return store


def test_names_are_whole_and_distinct_for_long_schemas() -> None:
    common = "s" * 44
    names = {
        per_schema_name(prefix, schema)
        for prefix in ("consumer_idem_claim", "consumer_idem_check", "consumer_idem_check_done")
        for schema in (common + "aaaa", common + "bbbb", "short", "s" * 63)
    }
    assert len(names) == 12
    assert all(len(n) <= 63 for n in names)
    assert per_schema_name("consumer_idem_claim", "short") == "consumer_idem_claim_short"


async def test_two_stores_whose_schemas_share_a_long_start_keep_their_claims_apart(
    pg_pool: asyncpg.Pool,
) -> None:
    """The first store prepares its statements on a connection; the second then runs a unit
    and its redelivery there. Cut at 63 bytes, the second store's EXECUTE ran the first one's
    claim statement: its claim went into the other store's table, and the redelivery ran the
    effect again."""
    common = f"ci_{uuid.uuid4().hex}".ljust(44, "x")
    first = await migrated(pg_pool, common + "aaaa")
    second = await migrated(pg_pool, common + "bbbb")
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS schema_name_effects (store text, key text)")

    def work(which: str) -> Any:
        async def write(conn: asyncpg.Connection) -> dict[str, str]:
            await conn.execute("INSERT INTO schema_name_effects VALUES ($1, 'k')", which)
            return {"by": which}

        return write

    async with pg_pool.acquire() as conn:
        warm = await run_transactional(first, "scope", "warm", FP, work("warm"), conn=conn)
        assert warm.kind is OutcomeKind.EXECUTED
        outcomes = [
            (await run_transactional(second, "scope", "k", FP, work("second"), conn=conn)).kind
            for _ in range(2)  # a delivery and its redelivery
        ]
    assert outcomes == [OutcomeKind.EXECUTED, OutcomeKind.REPLAYED]
    count = await pg_pool.fetchval(
        "SELECT count(*) FROM schema_name_effects WHERE store = 'second'"
    )
    assert count == 1, f"the effect ran {count} times"
    record = await second.get("scope", "k")
    assert record is not None and record.result == {"by": "second"}
    assert await first.get("scope", "k") is None


@pytest.mark.parametrize("length", [40, 63])
async def test_a_long_schema_prepares_its_statements_again_after_a_handler_dropped_one(
    pg_pool: asyncpg.Pool, length: int
) -> None:
    """A handler deallocates the library's claim statement in a run of messages (claim ahead):
    the library prepares its statements again, which must find those still there under their
    real names; otherwise PREPARE fails with "already exists" and a healthy message after it
    is dead-lettered."""
    store = await migrated(pg_pool, f"ci_{uuid.uuid4().hex}".ljust(length, "y"))

    @idempotent_consumer(store, scope="scope", backoff=(0.01, 0.05))
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> dict[str, str]:
        key = message.json()["key"]
        if key == "k1":
            await conn.execute(f"DEALLOCATE {per_schema_name('consumer_idem_claim', store.schema)}")
        return {"booked": key}

    messages = [
        ConsumerMessage(body=f'{{"key": "{k}"}}'.encode(), headers={"idempotency-key": k.encode()})
        for k in ("k0", "k1", "k2", "k3")
    ]
    verdicts = await book.process_batch(messages)
    assert [v.action for v in verdicts] == [Action.ACK] * 4, verdicts
    assert all(v.outcome is not None and v.outcome.kind is OutcomeKind.EXECUTED for v in verdicts)
