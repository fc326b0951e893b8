"""The `consumer-idem` command line, run as a real subprocess against the real database."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

import pytest

from consumer_idem.stores.postgres import migrate
from tests._cli import cli


async def test_migrate_applies_once_then_reports_up_to_date(pg_dsn: str) -> None:
    schema = f"cli_{uuid.uuid4().hex[:8]}"
    code, out, _ = await cli("migrate", "--schema", schema, "--json", dsn=pg_dsn)
    every = [m.version for m in migrate.available()]
    assert code == 0 and json.loads(out) == {"applied": every}
    code, out, _ = await cli("migrate", "--schema", schema, dsn=pg_dsn)
    assert code == 0 and "up to date" in out


async def test_unreachable_database_is_a_clear_error() -> None:
    code, _, err = await cli("migrate", "--dsn", "postgresql://u:p@127.0.0.1:1/none")
    assert code == 2
    assert "cannot connect to PostgreSQL" in err and "Traceback" not in err


@pytest.mark.parametrize("pace", ["inf", "nan", "-1"])
async def test_a_prune_pace_that_is_no_pace_is_a_clear_error(pg_dsn: str, pace: str) -> None:
    code, _, err = await cli("prune", "--max-rows-per-s", pace, dsn=pg_dsn)
    assert code == 2 and "--max-rows-per-s" in err and "Traceback" not in err


async def test_invalid_schema_is_a_clear_error(pg_dsn: str) -> None:
    code, _, err = await cli("migrate", "--schema", "Bad-Name", dsn=pg_dsn)
    assert code == 2 and "invalid schema name" in err


async def test_stats_inspect_evict(pg_dsn: str, store: Any, scope: str) -> None:
    d = await store.reserve(scope, "k1", "v1:jcs:x")
    await store.complete(scope, "k1", d.token, {"ok": True})
    d = await store.reserve(scope, "k2", "v1:jcs:x")
    await store.mark_unknown(scope, "k2", d.token, "gateway timeout")

    code, out, _ = await cli("stats", "--scope", scope, "--json", dsn=pg_dsn)
    assert code == 0
    stats = json.loads(out)
    assert stats["scopes"][scope] == {
        "in_progress": 0,
        "completed": 1,
        "failed_retryable": 0,
        "unknown": 1,
        "expired": 0,
    }
    assert stats["oldest_unknown_s"] is not None

    code, out, _ = await cli("inspect", scope, "k1", "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out)["status"] == "completed"
    assert json.loads(out)["result"] == {"ok": True}
    code, _, err = await cli("inspect", "no-such-scope", "k1", dsn=pg_dsn)
    assert code == 2 and "unknown scope" in err
    code, _, err = await cli("inspect", scope, "missing", dsn=pg_dsn)
    assert code == 2 and "no record" in err

    code, _, err = await cli("evict", scope, "k1", dsn=pg_dsn)  # no terminal to confirm on
    assert code != 0 and await store.get(scope, "k1") is not None
    code, out, _ = await cli("evict", scope, "k1", "--yes", "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out)["evicted"] is True
    assert await store.get(scope, "k1") is None


async def test_sweep_and_prune(pg_dsn: str, pg_pool: Any, store: Any, scope: str) -> None:
    await store.reserve(scope, "zombie", "v1:jcs:x")
    await pg_pool.execute(
        f"UPDATE {store.table} SET locked_until = now() - interval '1 s' WHERE scope = $1", scope
    )
    code, out, _ = await cli("sweep", "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out)["zombies"] >= 1
    record = await store.get(scope, "zombie")
    assert record.status.value == "unknown"

    d = await store.reserve(scope, "old", "v1:jcs:x")
    await store.complete(scope, "old", d.token, 1)
    await pg_pool.execute(
        f"UPDATE {store.table} SET expires_at = now() - interval '1 s'"
        " WHERE scope = $1 AND key = 'old'",
        scope,
    )
    code, out, _ = await cli(
        "prune", "--batch-size", "10", "--max-rows-per-s", "0", "--json", dsn=pg_dsn
    )
    assert code == 0 and json.loads(out)["rows"] >= 1
    assert await store.get(scope, "old") is None


async def test_replay_dry_run_then_real(
    pg_dsn: str,
    pg_pool: Any,
    store: Any,
    settings: Any,
    kafka_topic_factory: Any,
    kafka_producer: Any,
) -> None:
    from examples.payments_producer import plan
    from handlers.payments import ensure_tables
    from tests._payments import ledger_count

    await ensure_tables(pg_pool)
    run_id = f"cli{uuid.uuid4().hex[:6]}"
    dlq = await kafka_topic_factory("cli.dlq")
    for m in plan(20, 0.0, 1, run_id):
        await kafka_producer.send(dlq, value=m.body, headers=[("idempotency-key", m.key.encode())])
    await kafka_producer.flush()
    args = (
        "replay",
        "--transport",
        "kafka",
        "--source",
        dlq,
        "--handler",
        "handlers.payments:ledger_consumer",
        "--json",
    )
    code, out, err = await cli(*args, "--dry-run", dsn=pg_dsn)
    assert code == 0, err
    assert json.loads(out)["execute"] == 20 and await ledger_count(pg_pool, run_id) == 0
    code, out, err = await cli(*args, "--rate", "200", dsn=pg_dsn)
    assert code == 0, err
    assert json.loads(out)["execute"] == 20 and await ledger_count(pg_pool, run_id) == 20


async def test_unreachable_broker_is_a_clear_error(pg_dsn: str) -> None:
    code, _, err = await cli(
        "replay",
        "--transport",
        "kafka",
        "--source",
        "x",
        "--handler",
        "handlers.payments:ledger_consumer",
        dsn=pg_dsn,
        CONSUMER_IDEM_KAFKA_BOOTSTRAP="127.0.0.1:1",
    )
    assert code == 2 and "error:" in err and "Traceback" not in err
    code, _, err = await cli(
        "replay",
        "--transport",
        "kafka",
        "--source",
        "x",
        "--handler",
        "nope:nothing",
        dsn=pg_dsn,
    )
    assert code == 2 and "cannot load" in err


async def test_reconcile_worker_resolves_a_parked_key(
    pg_dsn: str, store: Any, kafka_topic_factory: Any, scope: str
) -> None:
    source = await kafka_topic_factory("cli.reconcile")
    d = await store.reserve(scope, "pay-9", "v1:jcs:x")
    await store.mark_unknown(scope, "pay-9", d.token, "gateway timeout")  # never announced
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer_idem.cli",
        "reconcile",
        "--transport",
        "kafka",
        "--source",
        source,
        "--group",
        f"{source}-g",
        "--resolver",
        "tests._resolvers:gateway_says_charged",
        "--sweep-interval",
        "0.5",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(300):  # the sweeper announces it, the worker resolves it
            record = await store.get(scope, "pay-9")
            if record.status.value == "completed":
                break
            await asyncio.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert record.status.value == "completed"
    assert record.result == {"resolved_by": "cli-reconciler", "key": "pay-9"}
