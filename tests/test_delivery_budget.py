"""The delivery budget at its limit, against a real PostgreSQL: a key whose claim is in a
transaction still open on another consumer is neither run nor dead-lettered; what that
transaction ends with decides."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from consumer_idem import PostgresStore, header, idempotent_consumer
from consumer_idem.consumer import Action
from consumer_idem.transports.delivery_budget import DeliveryBudget


@pytest.fixture
async def budget(store: PostgresStore, scope: str) -> DeliveryBudget:
    """A budget of one delivery for ``scope``, its key ``k`` already at the limit."""

    @idempotent_consumer(store, scope=scope, key=header("idempotency-key"))
    async def handle(conn: asyncpg.Connection) -> None:
        raise AssertionError("never runs here")

    spent = DeliveryBudget(handle, 1)
    assert await spent.attempts.count(scope, "k", 1) == 1
    return spent


@pytest.fixture
async def elsewhere(store: PostgresStore, scope: str) -> AsyncIterator[asyncpg.Connection]:
    """Another consumer's transaction, open, holding the claim of ``k`` (not committed)."""
    async with store.pool.acquire() as conn:
        assert await store.fast_path.begin_and_claim(conn, scope, "k", "fp")
        try:
            yield conn
        finally:
            if conn.is_in_transaction():
                await conn.execute("ROLLBACK")


async def test_a_spent_key_claimed_by_an_open_transaction_elsewhere_waits(
    budget: DeliveryBudget, elsewhere: asyncpg.Connection
) -> None:
    verdict = await budget.admit("k", [])
    assert verdict is not None
    assert verdict.action is Action.RETRY and verdict.reason == "in_progress"


async def test_a_spent_key_runs_through_the_claim_engine_once_the_other_commits(
    budget: DeliveryBudget, elsewhere: asyncpg.Connection
) -> None:
    assert (await budget.admit("k", [])).action is Action.RETRY  # type: ignore[union-attr]
    await elsewhere.execute("COMMIT")
    counted: list[int] = []
    assert await budget.admit("k", counted) is None  # the claim engine replays it
    assert counted == [0]


async def test_a_spent_key_is_dead_lettered_once_the_other_rolls_back(
    budget: DeliveryBudget, elsewhere: asyncpg.Connection
) -> None:
    assert (await budget.admit("k", [])).action is Action.RETRY  # type: ignore[union-attr]
    await elsewhere.execute("ROLLBACK")
    verdict = await budget.admit("k", [])
    assert verdict is not None
    assert verdict.action is Action.DEAD_LETTER and verdict.reason == "max_deliveries"


async def test_a_spent_key_nobody_holds_is_dead_lettered_and_the_probe_leaves_no_row(
    budget: DeliveryBudget, store: PostgresStore, scope: str
) -> None:
    verdict = await budget.admit("k", [])
    assert verdict is not None and verdict.reason == "max_deliveries"
    assert await store.get(scope, "k") is None


async def test_a_spent_key_whose_probe_the_table_refuses_is_dead_lettered_not_handed_back(
    own_store: PostgresStore,
) -> None:
    """A deployment's own CHECK on the table (fingerprints are SHA-256 hex, say) refuses the
    probe's claim row: the probe tells nothing, and the key gets the verdict it had before the
    probe, a dead letter with its reason, instead of a refusal at every redelivery."""

    @idempotent_consumer(own_store, scope="s", key=header("idempotency-key"))
    async def handle(conn: asyncpg.Connection) -> None:
        raise AssertionError("never runs here")

    spent = DeliveryBudget(handle, 1)
    assert await spent.attempts.count("s", "k", 1) == 1
    await own_store.pool.execute(
        f"ALTER TABLE {own_store.table} ADD CONSTRAINT sha256_fingerprints"
        " CHECK (fingerprint ~ '^[0-9a-f]{64}$') NOT VALID"
    )
    verdict = await spent.admit("k", [])
    assert verdict is not None
    assert (verdict.action, verdict.reason) == (Action.DEAD_LETTER, "max_deliveries")
