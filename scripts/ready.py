"""Readiness of the services, each checked with a real client request.

The five the library talks to, and those of the tests of Postgres as deployed: PgBouncer in
transaction pooling mode (6432) and a primary (5433) with its streaming standby (5434).
Used by ``scripts/services``; prints a status table and exits non-zero naming what failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from consumer_idem.cli.settings import load_settings

READY_TOPIC = "consumer_idem.ready"
#: the test suite's defaults (tests/conftest.py reads the same variables)
PGBOUNCER_DSN = os.environ.get(
    "CONSUMER_IDEM_PGBOUNCER_DSN", "postgresql://postgres:postgres@127.0.0.1:6432/postgres"
)
PG_PRIMARY_DSN = os.environ.get(
    "CONSUMER_IDEM_PG_PRIMARY_DSN", "postgresql://postgres:postgres@127.0.0.1:5433/postgres"
)
PG_STANDBY_DSN = os.environ.get(
    "CONSUMER_IDEM_PG_STANDBY_DSN", "postgresql://postgres:postgres@127.0.0.1:5434/postgres"
)


async def check_postgres() -> str:
    import asyncpg

    conn = await asyncpg.connect(load_settings().pg_dsn, timeout=3)
    try:
        version = await conn.fetchval("SELECT current_setting('server_version')")
    finally:
        await conn.close()
    return f"PostgreSQL {version}"


async def check_pgbouncer() -> str:
    import asyncpg

    # no statement cache: in transaction pooling mode a prepared statement may be gone
    conn = await asyncpg.connect(PGBOUNCER_DSN, timeout=3, statement_cache_size=0)
    try:
        version = await conn.fetchval("SELECT current_setting('server_version')")
    finally:
        await conn.close()
    # The admin console speaks only the simple query protocol, which asyncpg does not expose
    # for reading rows: ask psql (installed with PostgreSQL) for the pooling mode.
    console = urlsplit(PGBOUNCER_DSN)._replace(path="/pgbouncer").geturl()
    psql = await asyncio.create_subprocess_exec(
        "psql", "-XAt", "-F", "=", "-c", "SHOW CONFIG", console,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await psql.communicate()
    if psql.returncode:
        raise RuntimeError(f"the admin console did not answer: {err.decode().strip()[:80]}")
    config = dict(line.split("=")[:2] for line in out.decode().splitlines() if "=" in line)
    mode = config.get("pool_mode", "?")
    return f"PgBouncer, {mode} pooling, to PostgreSQL {version}"


async def check_pg_node(dsn: str, standby: bool) -> str:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        in_recovery = await conn.fetchval("SELECT pg_is_in_recovery()")
        read_only = await conn.fetchval("SELECT current_setting('default_transaction_read_only')")
        streaming = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'"
        )
    finally:
        await conn.close()
    if standby and not (in_recovery and streaming):
        raise RuntimeError(
            "not a streaming standby (promoted?): `scripts/services pair reset` rebuilds it"
        )
    if not standby and (in_recovery or read_only == "on"):
        raise RuntimeError("not a writable primary: `scripts/services pair reset` restores it")
    return "standby, streaming" if standby else "primary, read-write"


async def check_pg_primary() -> str:
    return await check_pg_node(PG_PRIMARY_DSN, standby=False)


async def check_pg_standby() -> str:
    return await check_pg_node(PG_STANDBY_DSN, standby=True)


async def check_kafka() -> str:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = AIOKafkaAdminClient(
        bootstrap_servers=load_settings().kafka_bootstrap, request_timeout_ms=5000
    )
    await admin.start()
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            await admin.create_topics([NewTopic(READY_TOPIC, 1, 1)])
        topics = await admin.list_topics()
        if READY_TOPIC not in topics:
            raise RuntimeError("topic creation not visible in metadata yet")
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    return f"Kafka cluster {cluster['cluster_id']}"


async def check_rabbitmq() -> str:
    import aio_pika

    conn = await aio_pika.connect(load_settings().amqp_url, timeout=3)
    try:
        channel = await conn.channel(publisher_confirms=True)
        await channel.close()
        props = conn.transport.connection.server_properties if conn.transport else {}
    finally:
        await conn.close()
    version = props.get("version", b"?")
    return f"RabbitMQ {version.decode() if isinstance(version, bytes) else version}"


async def check_redis() -> str:
    import redis.asyncio as aioredis

    client = aioredis.from_url(load_settings().redis_url, socket_timeout=3)
    try:
        if not await client.ping():
            raise RuntimeError("PING did not answer PONG")
        info = await client.info("server")
    finally:
        await client.aclose()
    return f"Redis {info.get('redis_version', '?')}"


async def check_nats() -> str:
    """The server's INFO greeting (NATS's protocol opens with it): it must say JetStream is on.
    Read with a plain socket so the check needs no client library."""
    url = urlsplit(load_settings().nats_url)
    reader, writer = await asyncio.open_connection(url.hostname or "127.0.0.1", url.port or 4222)
    try:
        line = await reader.readline()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if not line.startswith(b"INFO "):
        raise RuntimeError(f"not a NATS greeting: {line[:60]!r}")
    info = json.loads(line[5:])
    if not info.get("jetstream"):
        raise RuntimeError("JetStream is not enabled (start nats-server with -js)")
    return f"NATS {info.get('version', '?')} (JetStream)"


CHECKS: dict[str, tuple[str, Callable[[], Awaitable[str]]]] = {
    "postgres": ("127.0.0.1:5432", check_postgres),
    "kafka": ("127.0.0.1:9092", check_kafka),
    "rabbitmq": ("127.0.0.1:5672", check_rabbitmq),
    "redis": ("127.0.0.1:6379", check_redis),
    "nats": ("127.0.0.1:4222", check_nats),
    "pgbouncer": ("127.0.0.1:6432", check_pgbouncer),
    "pg-primary": ("127.0.0.1:5433", check_pg_primary),
    "pg-standby": ("127.0.0.1:5434", check_pg_standby),
}


async def wait_ready(name: str, budget_s: float) -> tuple[bool, str, float]:
    start = time.monotonic()
    last = "not tried"
    while True:
        try:
            detail = await asyncio.wait_for(CHECKS[name][1](), timeout=10)
            return True, detail, time.monotonic() - start
        except Exception as exc:  # any failure means "not ready yet"; keep the last reason
            last = f"{type(exc).__name__}: {exc}".strip()[:120]
        if time.monotonic() - start >= budget_s:
            return False, last, time.monotonic() - start
        await asyncio.sleep(1)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--log", action="append", default=[], help="service=path of its log")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated services")
    args = parser.parse_args()
    names = [name for name in CHECKS if name in args.only.split(",")]
    # Client libraries log every refused connection while a service boots; the table says enough.
    logging.disable(logging.CRITICAL)
    logs = dict(item.split("=", 1) for item in args.log)
    results = await asyncio.gather(*(wait_ready(name, args.timeout) for name in names))
    print(f"{'service':<10} {'address':<16} {'state':<8} {'secs':>5}  detail")
    failed = []
    for name, (ok, detail, secs) in zip(names, results, strict=True):
        address = CHECKS[name][0]
        state = "ready" if ok else "FAILED"
        print(f"{name:<10} {address:<16} {state:<8} {secs:5.1f}  {detail}")
        if not ok:
            failed.append(name)
    for name in failed:
        print(
            f"{name} did not become ready; its log: {logs.get(name, '(docker compose logs)')}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
