"""Helpers of the outbox tests: a producer, the outbox's rows, a TCP proxy a test can cut (a
broker outage that only the test's own connections see), and a child process that commits a
unit and dies before dispatching it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from consumer_idem import PostgresStore

FP = "v1:jcs:outbox"


@contextlib.asynccontextmanager
async def producer(bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    """A producer as the outbox wants one: acks=all, idempotent."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


def outbox_store(pool: asyncpg.Pool, relay_after: float = 0.0) -> PostgresStore:
    """A store of the test's own (its dispatchers and relay delay are the test's), on the
    session's migrated schema; its messages are due for a relay ``relay_after`` seconds after
    the commit."""
    store = PostgresStore(pool)
    store.outbox.relay_after = relay_after
    return store


async def rows(store: PostgresStore, scope: str) -> list[Any]:
    """The outbox rows of ``scope``, oldest first (through the store's own pool, whatever it
    is: an asyncpg pool or an application's engine)."""
    async with store.connection() as conn:
        sql = f"SELECT * FROM {store.outbox.table} WHERE scope = $1 ORDER BY id"
        return list(await conn.fetch(sql, scope))


def header(record: Any, name: str = "idempotency-key") -> str:
    return bytes(dict(record.headers or ())[name]).decode()


class Proxy:
    """A TCP proxy on loopback to ``host:port``: :meth:`cut` drops every connection through it
    and refuses new ones (the broker is down, for the clients that use the proxy), until
    :meth:`restore`. :meth:`drop_on` drops one connection, at the moment its client sends
    a given statement (a network fault at a precise point of a conversation)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._drop_on: bytes | None = None
        self.dropped = 0
        self._delay_on: tuple[bytes, float] | None = None

    def drop_on(self, statement: bytes) -> None:
        """Drop the next connection whose client sends bytes holding ``statement`` (they are
        not forwarded): both of its sides are reset."""
        self._drop_on = statement

    def delay_on(self, statement: bytes, seconds: float) -> None:
        """Hold the next bytes holding ``statement`` back for ``seconds`` (a stalled network)."""
        self._delay_on = (statement, seconds)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self.listen_port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if src is reader and self._drop_on is not None and self._drop_on in data:
                        self._drop_on = None
                        self.dropped += 1
                        writer.transport.abort()
                        up_writer.transport.abort()
                        return
                    if src is reader and self._delay_on is not None and self._delay_on[0] in data:
                        seconds, self._delay_on = self._delay_on[1], None
                        await asyncio.sleep(seconds)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()


# --- the child of the crash test -------------------------------------------------------------


class DieOnSend:
    """A sender that kills its process (SIGKILL) the moment a dispatch starts: the process dies
    after the unit's COMMIT, before anything of it reached the broker."""

    route = "kafka"  # it stands in for a KafkaOutboxSender (of no named cluster)

    def permanent(self, exc: BaseException) -> bool:
        return False

    async def send_batch(self, messages: Any) -> list[BaseException | None]:
        print(json.dumps({"event": "dispatching", "messages": len(messages)}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


async def _commit_and_die(dsn: str, scope: str, key: str, topic: str) -> None:
    """Commits a unit with one outgoing message, its dispatch attached as a runner attaches it,
    and dies by SIGKILL when the dispatch starts, right after the COMMIT."""
    from consumer_idem import run_transactional
    from consumer_idem.outbox import OutboxService, outbox_for

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    assert pool is not None
    store = outbox_store(pool)
    async with OutboxService(store, DieOnSend(), relay_interval=None):

        async def book(conn: asyncpg.Connection) -> str:
            await conn.execute("SELECT 1")
            outbox_for(conn).publish(topic, {"payment_id": key, "booked": True}, key=key)
            return "booked"

        await run_transactional(store, scope, key, FP, book)
        await asyncio.sleep(30)  # the dispatch kills us


if __name__ == "__main__":
    asyncio.run(_commit_and_die(*sys.argv[1:5]))


async def sent_keys(store: PostgresStore, scope: str, position: int = 0) -> dict[str, str]:
    """unit key -> the ``idempotency-key`` of its message at ``position``, as derived from the
    row's unit and run (and checked against the key the row stores)."""
    from consumer_idem.outbox import outgoing_key

    keys = {}
    for r in await rows(store, scope):
        if r["position"] == position:
            derived = outgoing_key(scope, r["unit_key"], position, str(r["run"]))
            assert derived == r["idempotency_key"], (derived, r["idempotency_key"])
            keys[r["unit_key"]] = derived
    return keys
