"""Helpers shared by the consumer tests: the demo tables, waiting, reading topics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from examples.payments_producer import PlannedMessage, expected_balances


async def ledger_count(pool: asyncpg.Pool, run_id: str) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM demo_ledger WHERE payment_id LIKE $1", f"{run_id}-%"
        )
    )


async def balances(pool: asyncpg.Pool, run_id: str) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT customer_id, balance_cents FROM demo_accounts WHERE customer_id LIKE $1",
        f"{run_id}-%",
    )
    return {r["customer_id"]: r["balance_cents"] for r in rows}


async def assert_exactly_once(
    pool: asyncpg.Pool, run_id: str, messages: list[PlannedMessage]
) -> None:
    distinct = len({m.key for m in messages})
    assert await ledger_count(pool, run_id) == distinct
    doubled = await pool.fetchval(
        "SELECT count(*) FROM (SELECT payment_id FROM demo_ledger WHERE payment_id LIKE $1"
        " GROUP BY payment_id HAVING count(*) > 1) d",
        f"{run_id}-%",
    )
    assert doubled == 0
    assert await balances(pool, run_id) == expected_balances(messages)


async def wait_until(
    check: Callable[[], Awaitable[bool]], within: float, what: str = "condition"
) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.1)


async def read_topic(bootstrap: str, topic: str, count: int, within: float = 20) -> list[Any]:
    """Every record of ``topic`` from the start (no group), until ``count`` were seen."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[Any] = []
    try:
        deadline = time.monotonic() + within
        while len(records) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
    finally:
        await consumer.stop()
    return records


async def send_raw(
    producer: AIOKafkaProducer,
    topic: str,
    items: list[tuple[dict[str, bytes], bytes]],
    partition: int | None = None,
) -> None:
    for headers, body in items:
        await producer.send_and_wait(
            topic, value=body, headers=list(headers.items()), partition=partition
        )


def payment(run_id: str, n: int, amount: int = 500, customer: str = "c") -> bytes:
    return json.dumps(
        {
            "payment_id": f"{run_id}-pay-{n}",
            "customer_id": f"{run_id}-{customer}",
            "amount_cents": amount,
            "currency": "EUR",
        }
    ).encode()
