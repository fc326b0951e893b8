"""FastStream JetStream consumer processes SIGKILLed mid-run, then restarted: every message's
effect exactly once, none lost (see ``tests/_faststream_nats_child.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator

import asyncpg
import nats
import pytest
from nats.js import api

from consumer_idem import PostgresStore
from tests._payments import wait_until
from tests.conftest import ROOT_DIR, unique

KEYS = 200
#: the last keys are published again under other dedup ids, after all the others: their copies
#: run after the kills, which land among the first keys (a copy would hide the loss of a first)
REPEATED = range(150, KEYS)


@pytest.fixture
async def children() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Child processes a test started are killed when it ends, whatever happened."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def start_child(
    children: list[asyncio.subprocess.Process],
    pg_dsn: str,
    *args: str,
    module: str = "tests._faststream_nats_child",
) -> asyncio.subprocess.Process:
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
    children.append(proc)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    assert line and json.loads(line)["event"] == "started", line
    return proc


async def effects_by_key(pool: asyncpg.Pool, scope: str) -> Counter[str]:
    rows = await pool.fetch("SELECT key FROM fs_effects WHERE scope = $1", scope)
    return Counter(r["key"] for r in rows)


async def test_nats_consumer_sigkilled_mid_run_loses_and_doubles_nothing(
    nats_url: str,
    pg_dsn: str,
    store: PostgresStore,  # migrated
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    children: list[asyncio.subprocess.Process],
) -> None:
    subject = unique("fsnk")
    client = await nats.connect(nats_url)
    try:
        js = client.jetstream()
        await js.add_stream(api.StreamConfig(name=subject, subjects=[subject, f"{subject}.dlq"]))
        for copy, keys in (("a", range(KEYS)), ("b", REPEATED)):
            for i in keys:
                await js.publish(
                    subject,
                    json.dumps({"n": i}).encode(),
                    headers={"idempotency-key": f"k{i}", "Nats-Msg-Id": f"k{i}-{copy}"},
                )
        rng = random.Random(scope)
        # killed before the commit, between the commit and the ack, after the ack, anywhere
        for step in ("handler", "committed", "acked", "random"):
            if step == "random":
                proc = await start_child(children, pg_dsn, subject, scope, "none", "0")
                target = (await effects_by_key(pg_pool, scope)).total() + rng.randint(10, 30)

                async def under_way(target: int = target) -> bool:
                    return (await effects_by_key(pg_pool, scope)).total() >= target

                await wait_until(under_way, 30, "the child to be under way")
                proc.send_signal(signal.SIGKILL)
            else:
                proc = await start_child(children, pg_dsn, subject, scope, step, "20")
            await asyncio.wait_for(proc.wait(), timeout=30)
            assert proc.returncode == -signal.SIGKILL
        done = (await effects_by_key(pg_pool, scope)).total()
        assert 0 < done < KEYS, f"the kills must land mid-run ({done})"
        final = await start_child(children, pg_dsn, subject, scope, "none", "0")
        try:

            async def all_acked() -> bool:
                info = await js.consumer_info(subject, "worker")
                return info.num_pending == 0 and info.num_ack_pending == 0

            await wait_until(all_acked, 30, "every message to be acked")
        finally:
            final.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(final.communicate(), timeout=30)
        stats = json.loads(out.splitlines()[-1])
        assert stats["dead_lettered"] == 0
        await js.delete_stream(subject)
    finally:
        await client.close()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(KEYS)})


async def test_nats_message_killing_the_consumer_is_dead_lettered_after_max_deliveries(
    nats_url: str,
    pg_dsn: str,
    store: PostgresStore,  # migrated
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    children: list[asyncio.subprocess.Process],
) -> None:
    # each child SIGKILLs itself in the handler of its first message, before the commit: only
    # the delivery budget (the redeliveries, counted in Postgres ahead of the handler) stops
    # the crash loop
    subject = unique("fsnp")
    client = await nats.connect(nats_url)
    kills = 0
    try:
        js = client.jetstream()
        await js.add_stream(api.StreamConfig(name=subject, subjects=[subject, f"{subject}.dlq"]))
        for _ in range(4):  # max_deliveries=2: 3 crashed runs, then the dead letter
            proc = await start_child(children, pg_dsn, subject, scope, "handler", "1", "2")
            if kills == 0:
                await js.publish(subject, b'{"n": 1}', headers={"idempotency-key": "poison"})
            try:
                await asyncio.wait_for(proc.wait(), timeout=8)  # > ack_wait: redelivered
            except TimeoutError:
                break  # it ran nothing: dead-lettered
            assert proc.returncode == -signal.SIGKILL
            kills += 1
        dead = await js.get_last_msg(subject, f"{subject}.dlq")
        assert dead.headers is not None
        assert dead.headers["x-dead-letter-reason"] == "max_deliveries"
        assert dead.headers["x-dead-letter-key"] == "poison"
        assert kills == 3  # the first run (uncounted) and max_deliveries counted runs
        assert (await effects_by_key(pg_pool, scope)).total() == 0
    finally:
        await js.delete_stream(subject)
        await client.close()


async def test_nats_batch_member_killing_the_consumer_is_dead_lettered_and_its_mates_run_once(
    nats_url: str,
    pg_dsn: str,
    store: PostgresStore,  # migrated
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    children: list[asyncio.subprocess.Process],
) -> None:
    # one batch of six; each child SIGKILLs itself before the commit of any batch holding the
    # poison: only the members' delivery budget (a redelivered member runs alone, counted in
    # Postgres ahead of its handler) stops the crash loop
    subject = unique("fsnbp")
    client = await nats.connect(nats_url)
    kills = 0
    try:
        js = client.jetstream()
        await js.add_stream(api.StreamConfig(name=subject, subjects=[subject, f"{subject}.dlq"]))
        for n, key in enumerate(["g0", "g1", "g2", "poison", "g3", "g4"]):
            body = {"n": n, "poison": key == "poison"}
            await js.publish(subject, json.dumps(body).encode(), headers={"idempotency-key": key})
        child = "tests._faststream_nats_batch_child"
        for _ in range(6):  # max_deliveries=2: 3 crashed runs, then the dead letter
            proc = await start_child(children, pg_dsn, subject, scope, "2", module=child)
            try:
                await asyncio.wait_for(proc.wait(), timeout=8)  # > ack_wait: redelivered
            except TimeoutError:
                break  # still running: the poison is gone
            assert proc.returncode == -signal.SIGKILL
            kills += 1
        # the batch's run (uncounted) and max_deliveries counted runs of the poison alone
        assert kills == 3, f"{kills} crashed runs: the batch crash-loops"
        try:

            async def all_acked() -> bool:
                info = await js.consumer_info(subject, "worker")
                return info.num_pending == 0 and info.num_ack_pending == 0

            await wait_until(all_acked, 15, "every member to be acked")
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        assert json.loads(out.splitlines()[-1])["dead_lettered"] == 1
        dead = await js.get_last_msg(subject, f"{subject}.dlq")
        assert dead.headers is not None
        assert dead.headers["x-dead-letter-reason"] == "max_deliveries"
        assert dead.headers["x-dead-letter-key"] == "poison"
        assert json.loads(dead.data)["poison"] is True
    finally:
        await js.delete_stream(subject)
        await client.close()
    assert await effects_by_key(pg_pool, scope) == Counter({f"g{i}": 1 for i in range(5)})
