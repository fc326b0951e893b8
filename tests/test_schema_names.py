"""The library's per-store identifiers (prepared statements, the NOTIFY channel) stay distinct
and whole for every valid schema name, up to 63 characters: PostgreSQL cuts an identifier at
63 bytes without a word, so a name built as ``prefix_schema`` could be cut into another
store's, or into a name the library then cannot find again."""

from __future__ import annotations

import re
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
from consumer_idem.commit import run_check_sql
from consumer_idem.consumer import Action
from consumer_idem.stores.postgres.migrate import per_schema_name, validate_schema
from consumer_idem.testing.faults import LIBRARY_COMMIT, Point, point_of

FP = "v1:jcs:schema-names"


async def migrated(pool: asyncpg.Pool, schema: str) -> PostgresStore:
    store = PostgresStore(pool, schema=validate_schema(schema))
    await store.migrate()
    return store


def test_names_are_whole_and_distinct_for_long_schemas(pg_pool: asyncpg.Pool) -> None:
    common = "s" * 44
    schemas = [common + "aaaa", common + "bbbb", "short", "done_short", "s" * 63, "x"]
    stores = [PostgresStore(pg_pool, schema=s) for s in schemas]
    names = [
        name
        for store in stores
        for name in (
            store.fast_path._claim_stmt,
            store.fast_path._result_stmt,
            store.fast_path._check_stmt,
            store.fast_path._check_done_stmt,
        )
    ]
    # (a check named for schema "done_short" was once the check_done of schema "short")
    assert len(set(names)) == len(names), sorted(names)
    assert all(len(n) <= 63 for n in names)
    assert per_schema_name("consumer_idem_claim", "short") == "consumer_idem_claim_short"


def test_a_schema_with_a_trailing_newline_is_refused() -> None:
    """A newline in an unquoted identifier is whitespace to PostgreSQL: "orders\n" would name
    the statements of schema "orders" (and a pattern's "$" matches before a final newline)."""
    with pytest.raises(ValueError, match="invalid schema name"):
        validate_schema("orders\n")
    with pytest.raises(ValueError, match="invalid schema name"):
        PostgresStore(asyncpg.Pool.__new__(asyncpg.Pool), schema="orders\n")


def test_the_fault_kit_knows_the_statements_of_a_long_schema(pg_pool: asyncpg.Pool) -> None:
    """The testing kit places faults by the library's statement names, in both forms."""
    for schema in ("short", "s" * 63):
        fast = PostgresStore(pg_pool, schema=schema).fast_path
        claim = fast._begin_and_claim_sql("scope", "k", FP, None, None, "00ff")
        assert point_of(claim) is Point.CLAIM, claim
        ahead = f"{run_check_sql(fast._check_done_stmt, '00ff')}; COMMIT; {claim}"
        assert point_of(ahead) is Point.COMMIT, ahead
        assert re.search(LIBRARY_COMMIT, ahead)
        assert re.search(LIBRARY_COMMIT, fast.check("00ff"))


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
