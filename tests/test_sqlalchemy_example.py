"""The contract of ``examples/orders_sqlalchemy.py``, through its ``app`` (httpx ASGI transport,
its start-up run as uvicorn would), on the real Postgres named by ``CONSUMER_IDEM_PG_DSN``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import unique


@pytest.fixture
async def client(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.setenv("CONSUMER_IDEM_PG_DSN", pg_dsn)
    from examples.orders_sqlalchemy import app

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
    ):
        yield c


async def orders(pool: asyncpg.Pool, sku: str) -> list[dict[str, Any]]:
    rows = await pool.fetch("SELECT id, sku, qty FROM sa_orders WHERE sku = $1", sku)
    return [dict(r) for r in rows]


async def test_start_up_migrates_the_store_and_creates_sa_orders(
    client: httpx.AsyncClient, pg_pool: asyncpg.Pool
) -> None:
    columns = {
        r["column_name"]: r["data_type"]
        for r in await pg_pool.fetch(
            "SELECT column_name, data_type FROM information_schema.columns"
            " WHERE table_name = 'sa_orders'"
        )
    }
    assert columns["sku"] == "text" and columns["qty"] == "integer"
    assert await pg_pool.fetchval("SELECT to_regclass('consumer_idem.idempotency_records')")


async def test_an_order_is_created_once_and_replayed(
    client: httpx.AsyncClient, pg_pool: asyncpg.Pool
) -> None:
    sku, key = unique("sku"), unique("key")
    created = await client.post(
        "/orders", json={"sku": sku, "qty": 2}, headers={"Idempotency-Key": key}
    )
    assert created.status_code == 201
    (row,) = await orders(pg_pool, sku)
    assert created.json() == {"id": row["id"], "sku": sku, "qty": 2}
    replayed = await client.post(
        "/orders", json={"sku": sku, "qty": 2}, headers={"Idempotency-Key": key}
    )
    assert replayed.status_code == 201 and replayed.content == created.content
    assert replayed.headers["idempotent-replayed"] == "true"
    reused = await client.post(
        "/orders", json={"sku": sku, "qty": 3}, headers={"Idempotency-Key": key}
    )
    assert reused.status_code == 422
    missing = await client.post("/orders", json={"sku": sku, "qty": 2})
    assert missing.status_code == 400
    assert len(await orders(pg_pool, sku)) == 1


async def test_a_failing_order_leaves_nothing_and_its_retry_runs_again(
    client: httpx.AsyncClient, pg_pool: asyncpg.Pool
) -> None:
    sku, key = unique("sku"), unique("key")
    for _ in range(3):
        failed = await client.post(
            "/orders/fail", json={"sku": sku, "qty": 1}, headers={"Idempotency-Key": key}
        )
        assert failed.status_code == 500
        assert "idempotent-replayed" not in failed.headers  # run again, never replayed
    assert await orders(pg_pool, sku) == []


async def test_twenty_concurrent_requests_with_one_key_make_one_order(
    client: httpx.AsyncClient, pg_pool: asyncpg.Pool
) -> None:
    sku, key = unique("sku"), unique("key")
    answers = await asyncio.gather(
        *(
            client.post("/orders", json={"sku": sku, "qty": 5}, headers={"Idempotency-Key": key})
            for _ in range(20)
        )
    )
    assert {a.status_code for a in answers} <= {201, 409}
    created = [a for a in answers if a.status_code == 201]
    assert created and len({a.content for a in created}) == 1
    assert len(await orders(pg_pool, sku)) == 1
