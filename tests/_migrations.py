"""Apply the store's migrations by hand, the way ``migrate.apply`` does: up to a version (a
store as an older release left it), or with the records table's SQL rewritten (partitioned)."""

from __future__ import annotations

from collections.abc import Callable

import asyncpg

from consumer_idem.stores.postgres import migrate


async def apply_by_hand(
    conn: asyncpg.Connection,
    schema: str,
    *,
    upto: int | None = None,
    rewrite: Callable[[int, str], str] = lambda version, sql: sql,
) -> None:
    """Create ``schema`` and apply the migrations up to ``upto`` (all by default), each one's
    SQL through ``rewrite(version, sql)``, in one transaction."""
    async with conn.transaction():
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for m in migrate.available():
            if upto is not None and m.version > upto:
                continue
            await conn.execute(rewrite(m.version, m.sql))
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                m.version,
                m.name,
            )
