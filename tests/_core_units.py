"""What the core's unit tests share: the fingerprint they claim with, the effect table (a
fixture) and its rows, and a message carrying its key in a header."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from consumer_idem import ConsumerMessage

FP = "v1:jcs:payload"


@pytest.fixture(scope="module")
async def ledger(pg_pool: asyncpg.Pool) -> str:
    await pg_pool.execute(
        "CREATE TABLE IF NOT EXISTS unit_ledger (scope text, key text, amount int,"
        " PRIMARY KEY (scope, key))"
    )
    return "unit_ledger"


def msg(key: str, body: Any) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps(body).encode(), headers={"idempotency-key": key.encode()}
    )


async def rows(pool: asyncpg.Pool, scope: str) -> dict[str, int]:
    found = await pool.fetch("SELECT key, amount FROM unit_ledger WHERE scope = $1", scope)
    return {r["key"]: r["amount"] for r in found}
