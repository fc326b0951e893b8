"""What the HTTP tests share: a client for an ASGI app, problem+json checks, and the fixtures
of a table endpoints write to and of a store whose database refuses connections (registered
for every test module by ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from consumer_idem import PostgresStore


def client_for(app: Any, host: str = "test") -> httpx.AsyncClient:
    """A client of ``app`` in this process: an exception in the app is its 500, not the test's."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url=f"http://{host}", timeout=30)


def is_problem(r: httpx.Response, status: int, kind: str) -> bool:
    """Is ``r`` the middleware's problem+json of this status and kind?"""
    return (
        r.status_code == status
        and r.headers.get("content-type") == "application/problem+json"
        and r.json()["type"].endswith(kind)
    )


async def rows(pool: asyncpg.Pool, table: str, key: str) -> list[str]:
    """What endpoints wrote under ``key`` in :func:`rows_table`."""
    return [r["what"] for r in await pool.fetch(f"SELECT what FROM {table} WHERE k = $1", key)]


@pytest.fixture(scope="module")
async def rows_table(pg_pool: asyncpg.Pool) -> str:
    """A table endpoints write ``(key, what)`` rows to, in their idempotency transaction."""
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS http_rows (k text, what text)")
    return "http_rows"


@pytest.fixture
async def refused() -> AsyncIterator[PostgresStore]:
    """A store whose database refuses connections: a proven outage."""
    pool = await asyncpg.create_pool("postgresql://postgres:postgres@127.0.0.1:1/x", min_size=0)
    assert pool is not None
    yield PostgresStore(pool, command_timeout=2)
    await pool.close()
