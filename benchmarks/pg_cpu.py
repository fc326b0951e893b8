"""CPU time of a PostgreSQL server and of this process, read from ``/proc`` (Linux).

Rates on a small machine that Postgres, the brokers and the client share drift from run to run;
the CPU Postgres spends per unit of work does much less, and it is what bounds a deployment
(consumers scale out over machines, Postgres stays one server). The server's CPU is the
postmaster's own, that of every live process it started (backends, the WAL writer, the
checkpointer, autovacuum...) and that of its children that exited (the kernel adds a reaped
child's time to its parent's ``cutime``/``cstime``). So it counts the whole cluster: run it on
a server that does nothing else meanwhile, or read it only as a comparison of alternating
rounds on the same server.
"""

from __future__ import annotations

import os
import resource
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 onwards), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def server_seconds(postmaster: int) -> float:
    """CPU seconds the server of ``postmaster`` used so far: itself, its live children and
    its exited ones."""
    own = _stat(postmaster)
    if own is None:
        raise RuntimeError(f"no process {postmaster}: is PostgreSQL local to this machine?")
    # utime, stime, cutime, cstime: fields 14-17, here 11-14 (the list starts at field 3)
    ticks = sum(int(v) for v in own[11:15])
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat(entry.name)
        if fields is not None and fields[1] == str(postmaster):  # field 4: the parent
            ticks += sum(int(v) for v in fields[11:15])
    return ticks / _TICKS


def own_seconds() -> float:
    """CPU seconds of this process and of its exited children (worker processes)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def postmaster_of(dsn: str) -> int:
    """The process id of the postmaster serving ``dsn``: the parent of a backend."""
    conn = await asyncpg.connect(dsn)
    try:  # read while the backend lives
        fields = _stat(await conn.fetchval("SELECT pg_backend_pid()"))
    finally:
        await conn.close()
    if fields is None:
        raise RuntimeError("cannot read the backend's /proc/<pid>/stat: is PostgreSQL local?")
    return int(fields[1])


@dataclass
class CpuMeter:
    """``start()`` then ``stop(units)``: µs of CPU per unit since ``start``, of the server
    (``pg_us``) and of this process with its exited children (``client_us``)."""

    postmaster: int
    pg_us: float = 0.0
    client_us: float = 0.0
    _pg0: float = 0.0
    _own0: float = 0.0

    def start(self) -> None:
        self._pg0, self._own0 = server_seconds(self.postmaster), own_seconds()

    def stop(self, units: int) -> CpuMeter:
        n = max(units, 1)
        self.pg_us = (server_seconds(self.postmaster) - self._pg0) / n * 1e6
        self.client_us = (own_seconds() - self._own0) / n * 1e6
        return self


class SidesCpu:
    """The CPU per message of each run of a plain and an idempotent side (this process, with
    its client library's threads, plus the whole Postgres server), metered around each run;
    `entry` gives the medians as a ``us/msg`` entry, the plain side as its baseline."""

    def __init__(self, postmaster: int) -> None:
        self.postmaster = postmaster
        self._meter = CpuMeter(postmaster)
        self.us: dict[bool, list[float]] = {False: [], True: []}

    def metered(
        self, idempotent: bool, messages: int, run: Callable[[], Awaitable[float]]
    ) -> Callable[[], Awaitable[float]]:
        """``run`` (one run of a side, settling ``messages``; its rate), metered."""

        async def go() -> float:
            self._meter.start()
            rate = await run()
            self._meter.stop(messages)
            self.us[idempotent].append(round(self._meter.pg_us + self._meter.client_us, 1))
            return rate

        return go

    def entry(self, name: str) -> dict[str, Any]:
        from benchmarks.common import entry

        return entry(
            name, statistics.median(self.us[True]), "us/msg", statistics.median(self.us[False])
        )
