"""Shared fixtures: real PostgreSQL, Kafka, RabbitMQ and Redis.

A service that does not answer fails the test that needs it, naming the service (never a skip):
`make test` starts the services first, and CI must not go green on a machine without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings, load_settings
from handlers.payments import ensure_tables
from tests._failover import (
    PG_PRIMARY_DSN,
    PG_STANDBY_DSN,
    PGBOUNCER_DSN,
    FailoverPair,
    PairScriptFailed,
    pair_script,
)
from tests._runners import Running

#: the HTTP tests' shared fixtures
pytest_plugins = ["tests._http"]

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def service_missing(name: str, target: str, exc: BaseException) -> None:
    ci = " (CI=true)" if os.environ.get("CI") == "true" else ""
    pytest.fail(
        f"{name} is not reachable at {target}{ci}: {type(exc).__name__}: {exc}. "
        "Start the services with `scripts/services up` (`make test` does it for you).",
        pytrace=False,
    )


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


#: fixtures that reach a service: a test using any of them (directly or through another
#: fixture) is marked ``services``; ``make test-fast`` runs the others with nothing started
SERVICE_FIXTURES = frozenset(
    {
        "pg_dsn",
        "kafka_admin",
        "kafka_producer",
        "amqp_connection",
        "redis_client",
        "nats_url",
        "gateway_url",
        "own_database",
        "pgbouncer_dsn",
        "failover_pair",
    }
)
#: test modules that reach a service from the test body (subprocesses, their own clients)
SERVICE_MODULES = frozenset({"test_services", "test_cli", "test_payments_api", "test_tracing"})
#: long runs (chaos with SIGKILLs, property-based HTTP fuzzing): marked ``slow`` as well
SLOW_MODULES = frozenset(
    {
        "test_chaos_postgres",
        "test_consumer_chaos",
        "test_store_processes",
        "test_payments_api",
        "test_chaos_pg_deployed",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "services: needs PostgreSQL, Kafka, RabbitMQ or Redis")
    config.addinivalue_line("markers", "slow: a chaos or fuzzing run (minutes, not seconds)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SERVICE_FIXTURES or module in SERVICE_MODULES:
            item.add_marker(pytest.mark.services)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@contextlib.asynccontextmanager
async def fresh_database(settings: Settings, prefix: str) -> AsyncIterator[str]:
    """A new database of the main server (named ``<prefix>_<random>``), its DSN, dropped after."""
    try:
        admin = await asyncpg.connect(settings.pg_dsn, timeout=5)
    except Exception as exc:
        service_missing("PostgreSQL", settings.pg_dsn, exc)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield with_database(settings.pg_dsn, name)
    admin = await asyncpg.connect(settings.pg_dsn, timeout=5)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
def settings() -> Settings:
    return load_settings()


@pytest.fixture(scope="session")
async def pg_dsn(settings: Settings) -> AsyncIterator[str]:
    """A fresh database for this test session, dropped at the end."""
    async with fresh_database(settings, "consumer_idem_test") as dsn:
        yield dsn


@pytest.fixture
async def own_database(settings: Settings) -> AsyncIterator[str]:
    """A database of the main server for one test only (the DSN straight to 5432), for a test
    that changes the database itself (``ALTER DATABASE``) or reaches it through PgBouncer."""
    async with fresh_database(settings, "consumer_idem_own") as dsn:
        yield dsn


@pytest.fixture(scope="session")
async def pgbouncer_dsn() -> str:
    """PgBouncer in transaction pooling mode in front of the main server (``scripts/services``
    starts it on 127.0.0.1:6432): any database of 5432, named in the DSN's path."""
    try:
        # no statement cache: in transaction mode a prepared statement may be gone next time
        conn = await asyncpg.connect(PGBOUNCER_DSN, timeout=5, statement_cache_size=0)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()
    except Exception as exc:
        service_missing("PgBouncer", PGBOUNCER_DSN, exc)
    return PGBOUNCER_DSN


@pytest.fixture
async def failover_pair() -> AsyncIterator[FailoverPair]:
    """The primary (5433) and its synchronous standby (5434) of ``scripts/services``, made
    fresh for this test (the primary writable, the standby a new base backup of it), with a
    database of this test's own; made fresh again afterwards, whatever the test did to them."""
    target = f"{PG_PRIMARY_DSN} + standby {PG_STANDBY_DSN}"
    try:
        await pair_script("reset")
    except (PairScriptFailed, OSError) as exc:
        service_missing("The fail-over pair (PostgreSQL primary and standby)", target, exc)
    pair = FailoverPair(
        PG_PRIMARY_DSN, PG_STANDBY_DSN, f"consumer_idem_pair_{uuid.uuid4().hex[:10]}"
    )
    for role, dsn in (("primary", PG_PRIMARY_DSN), ("standby", PG_STANDBY_DSN)):
        try:
            conn = await asyncpg.connect(dsn, timeout=5)
            await conn.close()
        except Exception as exc:
            service_missing(f"The fail-over pair's {role}", dsn, exc)
    await pair.create_database()
    yield pair
    await pair_script("reset")
    await pair.drop_database()


@pytest.fixture(scope="session")
def idem_dsn(pg_dsn: str) -> str:
    """The testing kit's database (``consumer_idem.testing``'s ``idem_store``): this session's."""
    return pg_dsn


@pytest.fixture(scope="session")
async def pg_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(pg_dsn, min_size=2, max_size=20)
    assert pool is not None
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
async def kafka_admin(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap, request_timeout_ms=10000
    )
    try:
        await admin.start()
        await admin.list_topics()
    except Exception as exc:
        await admin.close()
        service_missing("Kafka", settings.kafka_bootstrap, exc)
    yield admin
    await admin.close()


@pytest.fixture
async def kafka_topic_factory(kafka_admin: AIOKafkaAdminClient) -> AsyncIterator[Any]:
    """Creates unique topics (deleted after the test)."""
    created: list[str] = []

    async def make(prefix: str = "t", partitions: int = 1) -> str:
        name = unique(prefix)
        await kafka_admin.create_topics([NewTopic(name, partitions, 1)])
        created.append(name)
        return name

    yield make
    if created:
        await kafka_admin.delete_topics(created)


@pytest.fixture
async def kafka_producer(
    settings: Settings, kafka_admin: AIOKafkaAdminClient
) -> AsyncIterator[AIOKafkaProducer]:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    yield producer
    await producer.stop()


@pytest.fixture  # per test: a broker-restart test drops every connection
async def amqp_connection(settings: Settings) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    try:
        conn = await aio_pika.connect(settings.amqp_url, timeout=5)
    except Exception as exc:
        service_missing("RabbitMQ", settings.amqp_url, exc)
    yield conn
    await conn.close()


#: the arguments of the queues the tests declare: quorum queues count deliveries
QUORUM = {"x-queue-type": "quorum"}


async def delete_queues(settings: Settings, *names: str) -> None:
    """Delete these queues, on a connection of its own: the test's may have died with a broker
    restart."""
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)
    finally:
        await connection.close()


@pytest.fixture
def queue_name() -> str:
    """A unique queue name; tests declare it (auto-delete or delete it themselves)."""
    return unique("q")


@pytest.fixture(scope="session")
async def redis_client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(settings.redis_url, socket_timeout=5)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        service_missing("Redis", settings.redis_url, exc)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
async def nats_url(settings: Settings) -> str:
    """The NATS server's URL, once its greeting says JetStream is on (fails, never skips)."""
    parts = urlsplit(settings.nats_url)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or 4222), 5
        )
        try:
            greeting = await asyncio.wait_for(reader.readline(), 5)
        finally:
            writer.close()
        if not greeting.startswith(b"INFO ") or not json.loads(greeting[5:]).get("jetstream"):
            raise RuntimeError(f"not a NATS server with JetStream (-js): {greeting[:80]!r}")
    except Exception as exc:
        service_missing("NATS (JetStream)", settings.nats_url, exc)
    return settings.nats_url


@pytest.fixture
async def redis_prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A key prefix private to this test; its keys are deleted afterwards."""
    prefix = unique("test") + ":"
    yield prefix
    keys = [k async for k in redis_client.scan_iter(match=prefix + "*")]
    if keys:
        await redis_client.delete(*keys)


@pytest.fixture(scope="module")
async def demo_tables(pg_pool: asyncpg.Pool) -> None:
    """The tables of the example payment handlers (``handlers.payments``)."""
    await ensure_tables(pg_pool)


@pytest.fixture(scope="session")
async def store(pg_pool: asyncpg.Pool) -> PostgresStore:
    """The Postgres store on the session database, migrated once."""
    store = PostgresStore(pg_pool)
    await store.migrate()
    return store


@pytest.fixture
async def own_store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    """A store in a schema of its own, on one connection (its statistics and its table's
    constraints are this test's)."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    assert pool is not None
    store = PostgresStore(pool, schema=f"own_{uuid.uuid4().hex[:10]}")
    await store.migrate()
    yield store
    await pool.execute(f'DROP SCHEMA "{store.schema}" CASCADE')
    await pool.close()


@pytest.fixture(scope="session")
async def effects(pg_pool: asyncpg.Pool) -> None:
    """The FastStream tests' effect table (see ``tests/_faststream.py``)."""
    await pg_pool.execute(
        "CREATE TABLE IF NOT EXISTS fs_effects (scope text, key text, n int, at timestamptz"
        " DEFAULT now())"
    )


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    """Runners a test starts in the background (``running.start(runner)``), stopped at its end."""
    r = Running()
    yield r
    await r.stop_all()


@pytest.fixture
def scope() -> str:
    """A scope private to one test: records of different tests never meet."""
    return unique("scope")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
async def gateway_url() -> AsyncIterator[str]:
    """The stand-in payment gateway, a real uvicorn server on loopback."""
    import asyncio
    import sys

    import httpx

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        "examples.fake_gateway:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as client:
        for _ in range(100):
            try:
                await client.get(url + "/_stats")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.1)
        else:
            proc.kill()
            pytest.fail("the fake gateway did not start", pytrace=False)
    yield url
    proc.kill()  # a graceful stop would wait for a request the faults left hanging
    await proc.wait()
