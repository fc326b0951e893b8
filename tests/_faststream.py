"""Helpers shared by the FastStream tests: the ``fs_effects`` table (fixture ``effects`` in
conftest), written on the handler's connection; keyed records sent round-robin, the group's
committed offsets, and consumer processes started as children (fixture ``children``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from tests._payments import wait_until
from tests.conftest import ROOT_DIR


async def write_effect(conn: asyncpg.Connection, current: Any, n: int) -> None:
    """The handler's own effect, on the idempotency transaction's connection."""
    await conn.execute(
        "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)", current.scope, current.key, n
    )


async def effect_count(pool: asyncpg.Pool, scope: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM fs_effects WHERE scope = $1", scope))


async def effects_by_key(pool: asyncpg.Pool, scope: str) -> Counter[str]:
    rows = await pool.fetch("SELECT key FROM fs_effects WHERE scope = $1", scope)
    return Counter(r["key"] for r in rows)


def keyed(count: int, repeated: int = 0) -> list[tuple[str | None, bytes]]:
    """``count`` keyed records, then the first ``repeated`` of them again."""
    items: list[tuple[str | None, bytes]] = [
        (f"k{i}", json.dumps({"n": i}).encode()) for i in range(count)
    ]
    return items + items[:repeated]


async def send(
    producer: AIOKafkaProducer, topic: str, items: list[tuple[str | None, bytes]], partitions: int
) -> dict[int, int]:
    """``items`` round-robin over the partitions (key in header ``idempotency-key``); the end
    offset of each partition."""
    ends: Counter[int] = Counter()
    for i, (key, body) in enumerate(items):
        headers = [] if key is None else [("idempotency-key", key.encode())]
        await producer.send(topic, body, partition=i % partitions, headers=headers)
        ends[i % partitions] += 1
    await producer.flush()
    return dict(ends)


async def committed(admin: AIOKafkaAdminClient, group: str) -> dict[int, int]:
    offsets = await admin.list_consumer_group_offsets(group)
    return {tp.partition: meta.offset for tp, meta in offsets.items()}


async def wait_committed(
    admin: AIOKafkaAdminClient, group: str, offsets: dict[int, int], within: float = 40
) -> None:
    """Wait until the group committed exactly ``offsets`` (partition: next offset)."""

    async def settled() -> bool:
        return await committed(admin, group) == offsets

    await wait_until(settled, within, f"the group to commit {offsets}")


CHILDREN: list[asyncio.subprocess.Process] = []


@pytest.fixture
async def children() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Child processes a test started are killed when it ends, whatever happened."""
    yield CHILDREN
    for proc in CHILDREN:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    CHILDREN.clear()


async def start_child(module: str, pg_dsn: str, *args: str) -> asyncio.subprocess.Process:
    """``python -m module *args`` with the test database's DSN, once it printed
    ``{"event": "started"}``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        cwd=ROOT_DIR,
        env=dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn),
        stdout=asyncio.subprocess.PIPE,
        stderr=None,
    )
    CHILDREN.append(proc)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    assert line and json.loads(line)["event"] == "started", line
    return proc
