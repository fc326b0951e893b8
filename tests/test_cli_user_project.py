"""The installed ``consumer-idem`` command, run from the user's project directory, loads the
project's own modules (``--handler``, ``--resolver``, ``--local-writes``) without
``PYTHONPATH=.``, and takes the broker address as a flag (``--bootstrap-servers``,
``--amqp-url``) ahead of the ``CONSUMER_IDEM_*`` settings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings
from tests.conftest import ROOT_DIR, unique

#: the user's project: a handler factory, a resolver and its local writes
PROJECT_MODULE = textwrap.dedent(
    """
    import os

    from consumer_idem import Executed, idempotent_consumer, header


    def ledger(store):
        async def handle(message, conn):
            return {"booked": message.json()["n"]}

        return idempotent_consumer(
            store, scope=os.environ["SHOP_SCOPE"], key=header("idempotency-key")
        )(handle)


    async def resolve(record):
        return Executed({"resolved_by": "shop"})


    async def book(conn, result):
        await conn.execute(
            "INSERT INTO shop_books (scope, result) VALUES ($1, $2)",
            os.environ["SHOP_SCOPE"], str(result),
        )
    """
)

#: the ``consumer-idem`` console script as pip writes it: run from its own directory, it
#: puts that directory on sys.path, not the current one
CONSOLE_SCRIPT = "import sys\nfrom consumer_idem.cli import main\nsys.exit(main())\n"

#: broker settings that reach nothing: the flags must win over them
UNREACHABLE = {
    "CONSUMER_IDEM_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "CONSUMER_IDEM_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
}


def project(tmp_path: Path) -> tuple[Path, Path]:
    """(the project directory with ``shop.py``, the console script elsewhere)."""
    home = tmp_path / "project"
    home.mkdir()
    (home / "shop.py").write_text(PROJECT_MODULE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "consumer-idem").write_text(CONSOLE_SCRIPT)
    return home, bin_dir / "consumer-idem"


async def start_cli(
    script: Path, home: Path, env: dict[str, str], *args: str
) -> asyncio.subprocess.Process:
    """``consumer-idem ARGS`` run from ``home``, the user's project directory."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        cwd=home,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def environment(pg_dsn: str, scope: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(UNREACHABLE)
    env.update(
        PYTHONPATH=str(ROOT_DIR),  # the library only, as an installed package would be
        CONSUMER_IDEM_PG_DSN=pg_dsn,
        SHOP_SCOPE=scope,
        TTY_COMPATIBLE="0",
    )
    return env


async def test_replay_loads_the_handler_from_the_current_directory_and_takes_the_broker_flag(
    tmp_path: Path,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    settings: Settings,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
) -> None:
    home, script = project(tmp_path)
    dlq = await kafka_topic_factory("shop.dlq")
    for n in range(3):
        await kafka_producer.send(dlq, b'{"n": %d}' % n, headers=[("idempotency-key", b"k%d" % n)])
    await kafka_producer.flush()
    proc = await start_cli(
        script,
        home,
        environment(pg_dsn, scope),
        "replay",
        "--transport",
        "kafka",
        "--source",
        dlq,
        "--handler",
        "shop:ledger",
        "--bootstrap-servers",
        settings.kafka_bootstrap,
        "--json",
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert json.loads(out)["execute"] == 3


async def test_reconcile_loads_resolver_and_local_writes_from_the_current_directory(
    tmp_path: Path, pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore, scope: str
) -> None:
    home, script = project(tmp_path)
    await pg_pool.execute("CREATE TABLE IF NOT EXISTS shop_books (scope text, result text)")
    reserved = await store.reserve(scope, "pay-1", "v1:jcs:x")
    assert reserved.token is not None
    await store.mark_unknown(scope, "pay-1", reserved.token, "gateway timeout")
    source = unique("shop.reconcile")
    settings = Settings()
    proc = await start_cli(
        script,
        home,
        environment(pg_dsn, scope),
        "reconcile",
        "--transport",
        "rabbit",
        "--source",
        source,
        "--resolver",
        "shop:resolve",
        "--local-writes",
        f"{scope}=shop:book",
        "--amqp-url",
        settings.amqp_url,
        "--sweep-interval",
        "0.5",
    )
    record: Any = None
    try:
        for _ in range(300):  # the sweeper announces it, the reconciler resolves it
            record = await store.get(scope, "pay-1")
            if record.status.value == "completed" or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert record.status.value == "completed" and record.result == {"resolved_by": "shop"}
    books = await pg_pool.fetchval("SELECT count(*) FROM shop_books WHERE scope = $1", scope)
    assert books == 1
