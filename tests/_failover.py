"""The fail-over pair of ``scripts/services``: a primary (5433) and its synchronous streaming
standby (5434), rebuilt from a fresh base backup for every test that uses it, and the faults a
test plays on it: promote the standby, stop the primary as a crash would, demote the primary to
read-only while it stays up."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import asyncpg

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVICES = os.path.join(ROOT_DIR, "scripts", "services")

#: the defaults of ``scripts/services`` (``scripts/ready.py`` reads the same variables)
PGBOUNCER_DSN = os.environ.get(
    "CONSUMER_IDEM_PGBOUNCER_DSN", "postgresql://postgres:postgres@127.0.0.1:6432/postgres"
)
PG_PRIMARY_DSN = os.environ.get(
    "CONSUMER_IDEM_PG_PRIMARY_DSN", "postgresql://postgres:postgres@127.0.0.1:5433/postgres"
)
PG_STANDBY_DSN = os.environ.get(
    "CONSUMER_IDEM_PG_STANDBY_DSN", "postgresql://postgres:postgres@127.0.0.1:5434/postgres"
)


class PairScriptFailed(RuntimeError):
    """``scripts/services pair ...`` exited non-zero (its stderr in the message)."""


async def pair_script(action: str, within: float = 120) -> None:
    """Run ``scripts/services pair <action>`` (it needs root, or passwordless sudo)."""
    proc = await asyncio.create_subprocess_exec(
        SERVICES,
        "pair",
        action,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise PairScriptFailed(f"scripts/services pair {action} took over {within}s") from None
    if proc.returncode:
        tail = "\n".join((out + err).decode(errors="replace").splitlines()[-15:])
        raise PairScriptFailed(f"scripts/services pair {action} exited {proc.returncode}:\n{tail}")


def on_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


def multi_host(first: str, second: str, database: str) -> str:
    """One DSN naming both nodes, that connects to whichever accepts writes: what a user's
    application is given in front of a fail-over pair."""
    a, b = urlsplit(first), urlsplit(second)
    auth = a.netloc.rsplit("@", 1)[0]
    hosts = f"{a.netloc.rsplit('@', 1)[1]},{b.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(
        a._replace(
            netloc=f"{auth}@{hosts}", path=f"/{database}", query="target_session_attrs=read-write"
        )
    )


@dataclass
class FailoverPair:
    """One test's database on the pair, and the faults to play on it."""

    primary_dsn: str  #: the primary's ``postgres`` database
    standby_dsn: str  #: the standby's
    database: str

    @property
    def dsn(self) -> str:
        """The multi-host DSN (``target_session_attrs=read-write``) of this test's database."""
        return multi_host(self.primary_dsn, self.standby_dsn, self.database)

    async def _admin(self, dsn: str) -> asyncpg.Connection:
        return await asyncpg.connect(dsn, timeout=5)

    async def stop_primary(self) -> None:
        """The primary goes away at once (an immediate shutdown: a crash, to its clients)."""
        await pair_script("stop-primary", within=60)

    async def demote_primary(self) -> None:
        """The primary stays up but refuses writes, sessions already open included (what a
        fenced or demoted node does): ``default_transaction_read_only`` server-wide."""
        conn = await self._admin(self.primary_dsn)
        try:
            await conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()

    async def promote_standby(self) -> float:
        """Promote the standby; returns the seconds until it accepts writes."""
        started = time.monotonic()
        conn = await self._admin(self.standby_dsn)
        try:
            assert await conn.fetchval("SELECT pg_promote(true, 60)"), "promotion failed"
        finally:
            await conn.close()
        return time.monotonic() - started

    async def create_database(self) -> None:
        """This test's database, created on the primary and seen on the standby."""
        conn = await self._admin(self.primary_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            await conn.close()
        deadline = time.monotonic() + 30
        standby = await self._admin(self.standby_dsn)
        try:
            while not await standby.fetchval(
                "SELECT count(*) FROM pg_database WHERE datname = $1", self.database
            ):
                assert time.monotonic() < deadline, "the standby never replayed CREATE DATABASE"
                await asyncio.sleep(0.1)
        finally:
            await standby.close()

    async def drop_database(self) -> None:
        conn = await self._admin(self.primary_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        finally:
            await conn.close()
