"""Helpers shared by the FastStream tests: the ``fs_effects`` table (fixture ``effects`` in
conftest), written on the handler's connection."""

from __future__ import annotations

from typing import Any

import asyncpg


async def write_effect(conn: asyncpg.Connection, current: Any, n: int) -> None:
    """The handler's own effect, on the idempotency transaction's connection."""
    await conn.execute(
        "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)", current.scope, current.key, n
    )


async def effect_count(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM fs_effects WHERE scope = $1", scope))
