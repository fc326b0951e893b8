"""Round trips per path, counted on the wire by a TCP proxy in front of the real servers.

A round trip is a turn of the client's: it sends after the server has answered (or first).
Every path sends only what it needs:

* Postgres, transactional (``run_transactional``, the consumers, HTTP): a first execution is
  BEGIN + the claim, then the result + COMMIT (2); a duplicate is the claim, the reservation
  that reads the record, and the end of the transaction (3). Batch mode: BEGIN, the set-based
  claim, the checked COMMIT (3 for the whole batch).
* Postgres, two-phase: the reservation and the completion, each its own transaction (2); a
  duplicate, the reservation alone (1).
* Redis: a first execution is the reservation script and the completion script (2); a
  duplicate, the reservation script (1).

With asyncpg's default pool, every release adds one round trip (its reset query): that is the
pool the user gives, and ``consumer_idem.stores.postgres.pool.no_reset`` is how to drop it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import redis.asyncio as aioredis

from consumer_idem import (
    Attempt,
    ConsumerMessage,
    PostgresStore,
    RedisStore,
    header,
    idempotent_consumer,
    run_transactional,
    run_two_phase,
)
from consumer_idem.cli.settings import Settings
from consumer_idem.stores.postgres.pool import no_reset

FP = "v1:jcs:round-trips"


class RoundTrips:
    """A TCP proxy to ``host:port`` that counts the client's turns on every connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.count = 0
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        turn = ["server"]  # whose data went through last on this connection

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, side: str) -> None:
            try:
                while data := await src.read(65536):
                    if side == "client" and turn[0] != "client":
                        self.count += 1
                    turn[0] = side
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        for task in (pump(reader, up_writer, "client"), pump(up_reader, writer, "server")):
            self._pumps.add(asyncio.create_task(task))

    async def of(self, call: Callable[[], Awaitable[Any]]) -> int:
        """The round trips ``call()`` costs."""
        before = self.count
        await call()
        await asyncio.sleep(0.05)  # nothing in flight is left uncounted
        return self.count - before


@pytest.fixture
async def pg_proxy(pg_dsn: str) -> AsyncIterator[tuple[RoundTrips, str]]:
    parts = urlsplit(pg_dsn)
    proxy = RoundTrips(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await proxy.start()
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    yield proxy, urlunsplit(parts._replace(netloc=f"{credentials}127.0.0.1:{port}"))
    await proxy.close()


async def proxied_store(dsn: str, reset: Any, migrated: PostgresStore) -> PostgresStore:
    """A store (on the migrated schema) whose one pooled connection goes through the proxy;
    warmed up, so connecting and first-use statement preparation are not counted."""
    options: dict[str, Any] = {} if reset is None else {"reset": reset}
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, ssl=False, **options)
    assert pool is not None
    store = PostgresStore(pool, schema=migrated.schema)
    warm = f"warm-{uuid.uuid4().hex}"
    await run_transactional(store, "warm", warm, FP, nothing)
    await run_transactional(store, "warm", warm, FP, nothing)
    await run_two_phase(store, "warm", f"{warm}-2", FP, external)
    await run_two_phase(store, "warm", f"{warm}-2", FP, external)
    return store


async def nothing(conn: asyncpg.Connection) -> None:
    """A handler with no statement of its own: only the library's round trips are counted."""


async def external(attempt: Attempt) -> str:
    return "charged"


@pytest.mark.parametrize(("reset", "per_release"), [(no_reset, 0), (None, 1)])
async def test_postgres_round_trips_per_path(
    pg_proxy: tuple[RoundTrips, str], store: PostgresStore, reset: Any, per_release: int
) -> None:
    proxy, dsn = pg_proxy
    proxied = await proxied_store(dsn, reset, store)
    scope = f"rt-{uuid.uuid4().hex[:8]}"
    try:
        first = await proxy.of(lambda: run_transactional(proxied, scope, "k1", FP, nothing))
        duplicate = await proxy.of(lambda: run_transactional(proxied, scope, "k1", FP, nothing))
        assert (first, duplicate) == (2 + per_release, 3 + per_release)

        first = await proxy.of(lambda: run_two_phase(proxied, scope, "k2", FP, external))
        duplicate = await proxy.of(lambda: run_two_phase(proxied, scope, "k2", FP, external))
        assert (first, duplicate) == (2 + 2 * per_release, 1 + per_release)

        # the consumer's path is the transactional one
        @idempotent_consumer(proxied, scope=scope, key=header("idempotency-key"))
        async def one(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
            pass

        message = ConsumerMessage(b"{}", headers={"idempotency-key": b"k3"})
        assert await proxy.of(lambda: one.process(message)) == 2 + per_release
        assert await proxy.of(lambda: one.process(message.fresh())) == 3 + per_release

        # batch mode: BEGIN, the set-based claim, the checked COMMIT, for the whole batch
        @idempotent_consumer(proxied, scope=scope, key=header("idempotency-key"), batch=True)
        async def many(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
            pass

        def batch(prefix: str) -> list[ConsumerMessage]:
            keys = [f"{prefix}{i}".encode() for i in range(10)]
            return [ConsumerMessage(b"{}", headers={"idempotency-key": k}) for k in keys]

        await many.process_batch(batch("warm"))  # asyncpg prepares the claim on first use
        assert await proxy.of(lambda: many.process_batch(batch("b"))) == 3 + per_release
    finally:
        await proxied.pool.close()


async def test_redis_round_trips_per_path(settings: Settings, redis_prefix: str) -> None:
    url = urlsplit(settings.redis_url)
    proxy = RoundTrips(url.hostname or "127.0.0.1", url.port or 6379)
    port = await proxy.start()
    client = aioredis.from_url(urlunsplit(url._replace(netloc=f"127.0.0.1:{port}")))
    try:
        store = RedisStore(client, prefix=redis_prefix)
        await run_two_phase(store, "warm", "w", FP, external)  # connect, load the scripts
        first = await proxy.of(lambda: run_two_phase(store, "s", "k", FP, external))
        duplicate = await proxy.of(lambda: run_two_phase(store, "s", "k", FP, external))
        assert (first, duplicate) == (2, 1)
    finally:
        await client.aclose()
        await proxy.close()
