"""A private PostgreSQL cluster that stops assigning transaction IDs: its wraparound protection.

PostgreSQL refuses every write with SQLSTATE 54000 (``program_limit_exceeded``, the class that
also says "this key's index row is too big") once the oldest unfrozen transaction ID is close
to wrapping around: an outage of the whole server, which production databases meet when
vacuum falls behind. Made real here with ``pg_resetwal -x`` (the next transaction ID set just
past the stop limit) and held with a logical replication slot made before (its catalog xmin
keeps vacuum from freezing past it); dropping the slot lets autovacuum end the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg


def _bin_dir() -> str:
    out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
    if out.returncode == 0 and os.path.exists(os.path.join(out.stdout.strip(), "pg_resetwal")):
        return out.stdout.strip()
    base = "/usr/lib/postgresql"
    versions = sorted(os.listdir(base), key=int) if os.path.isdir(base) else []
    if not versions:
        raise RuntimeError("no PostgreSQL server binaries (initdb, pg_resetwal) found")
    return os.path.join(base, versions[-1], "bin")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class WrappedCluster:
    dsn: str
    slot_dsn: str


class _Cluster:
    """The private cluster's files and commands (blocking: run in a thread)."""

    def __init__(self) -> None:
        self.bindir = _bin_dir()
        self.root = tempfile.mkdtemp(prefix="ci-wrap-")
        os.chmod(self.root, 0o777)
        self.data = os.path.join(self.root, "data")
        self.port = _port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def run(self, *args: str) -> None:
        subprocess.run([*self.as_postgres, *args], check=True, capture_output=True, timeout=60)

    def ctl(self, *args: str) -> None:
        log = os.path.join(self.root, "log")
        self.run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-l", log, "-w", *args)

    def start(self) -> None:
        initdb = os.path.join(self.bindir, "initdb")
        self.run(initdb, "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        with open(os.path.join(self.data, "postgresql.conf"), "a") as conf:
            conf.write(
                f"port={self.port}\nlisten_addresses='127.0.0.1'\n"
                f"unix_socket_directories='{self.root}'\nwal_level=logical\n"
                "autovacuum_naptime=1\nfsync=off\n"
            )
        self.ctl("start")

    def wrap(self) -> None:
        """Hold vacuum back with a slot, then restart with the next XID past the stop limit."""
        sql = "SELECT pg_create_logical_replication_slot('hold', 'test_decoding')"
        subprocess.run(["psql", self.dsn, "-qAtc", sql], check=True, capture_output=True)
        self.ctl("-m", "fast", "stop")
        xid = 2**31 - 2_500_000  # past the stop limit (3 million before the wrap)
        segment = os.path.join(self.data, "pg_xact", f"{xid // 1_048_576:04X}")
        self.run("dd", "if=/dev/zero", f"of={segment}", "bs=262144", "count=1", "status=none")
        self.run(os.path.join(self.bindir, "pg_resetwal"), "-x", str(xid), "-D", self.data)
        self.ctl("start")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.ctl("-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@asynccontextmanager
async def wrapped_cluster(
    prepare: Callable[[str], Awaitable[None]],
) -> AsyncIterator[WrappedCluster]:
    """A cluster refusing every write for XID wraparound until :func:`end_episode`;
    ``prepare(dsn)`` runs first, while it still takes writes."""
    cluster = _Cluster()
    try:
        await asyncio.to_thread(cluster.start)
        await prepare(cluster.dsn)
        await asyncio.to_thread(cluster.wrap)
        yield WrappedCluster(dsn=cluster.dsn, slot_dsn=cluster.dsn)
    finally:
        await asyncio.to_thread(cluster.remove)


async def end_episode(cluster: WrappedCluster) -> None:
    """Drop the slot holding vacuum back: autovacuum then freezes and writes are taken again."""
    conn = await asyncpg.connect(cluster.slot_dsn)
    try:
        await conn.execute("SELECT pg_drop_replication_slot('hold')")
    finally:
        await conn.close()


async def takes_writes(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("BEGIN; SELECT pg_current_xact_id(); ROLLBACK")
        return True
    except asyncpg.PostgresError:
        return False
    finally:
        await conn.close()


async def until_writable(dsn: str, within: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await takes_writes(dsn):
        if loop.time() > deadline:
            raise TimeoutError(f"the cluster still refuses writes after {within}s")
        await asyncio.sleep(0.5)
