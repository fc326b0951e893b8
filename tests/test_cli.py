"""The `consumer-idem` command line, run as a real subprocess against the real database."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid


async def cli(*args: str, dsn: str | None = None) -> tuple[int, str, str]:
    env = dict(os.environ)
    if dsn:
        env["CONSUMER_IDEM_PG_DSN"] = dsn
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer_idem.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_migrate_applies_once_then_reports_up_to_date(pg_dsn: str) -> None:
    schema = f"cli_{uuid.uuid4().hex[:8]}"
    code, out, _ = await cli("migrate", "--schema", schema, "--json", dsn=pg_dsn)
    assert code == 0 and json.loads(out) == {"applied": [1]}
    code, out, _ = await cli("migrate", "--schema", schema, dsn=pg_dsn)
    assert code == 0 and "up to date" in out


async def test_unreachable_database_is_a_clear_error() -> None:
    code, _, err = await cli("migrate", "--dsn", "postgresql://u:p@127.0.0.1:1/none")
    assert code == 2
    assert "cannot connect to PostgreSQL" in err and "Traceback" not in err


async def test_invalid_schema_is_a_clear_error(pg_dsn: str) -> None:
    code, _, err = await cli("migrate", "--schema", "Bad-Name", dsn=pg_dsn)
    assert code == 2 and "invalid schema name" in err
