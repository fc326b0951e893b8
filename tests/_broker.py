"""Faults for the transport tests: restarting the RabbitMQ broker (the native node, or the
compose service), and a Postgres outage a test can start and end."""

from __future__ import annotations

import asyncio
import shutil
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from consumer_idem import PostgresStore
from tests.conftest import ROOT_DIR, free_port


async def _run(*cmd: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT_DIR, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err.decode()[-500:]}")


async def rabbitmqctl(*args: str) -> None:
    if shutil.which("rabbitmqctl"):
        await _run("rabbitmqctl", *args)
    else:  # the Docker path: the broker runs in the compose service
        await _run("docker", "compose", "exec", "-T", "rabbitmq", "rabbitmqctl", *args)


class Outage:
    """A store on a pool that points at a port nobody listens on, until :meth:`end` gives it
    the real pool: the database is unreachable for as long as the test wants."""

    def __init__(self, store: PostgresStore, dead: asyncpg.Pool) -> None:
        self.down = PostgresStore(dead, schema=store.schema, metrics=store.metrics)
        self.live = store.pool

    @classmethod
    async def start(cls, store: PostgresStore, dsn: str) -> Outage:
        parts = urlsplit(dsn)
        user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        netloc = f"{user}127.0.0.1:{free_port()}"
        dead = await asyncpg.create_pool(urlunsplit(parts._replace(netloc=netloc)), min_size=0)
        assert dead is not None
        return cls(store, dead)

    def end(self) -> None:
        self.down.pool = self.live
