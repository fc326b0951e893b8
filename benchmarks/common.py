"""Shared benchmark plumbing: a scratch database, timing, and the results file."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from consumer_idem.cli.settings import load_settings

RESULTS = Path(__file__).with_name("results.json")


@asynccontextmanager
async def scratch_database() -> AsyncIterator[str]:
    """A database of its own for one benchmark run, dropped afterwards."""
    admin_dsn = load_settings().pg_dsn
    name = f"consumer_idem_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{name}"))
    finally:
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def rate(op: Callable[[int], Awaitable[Any]], total: int, concurrency: int) -> float:
    """Operations per second of ``op(i)`` for i in range(total), ``concurrency`` at a time."""
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


async def interleaved(
    chunks: int,
    baseline: Callable[[int], Awaitable[float]],
    subject: Callable[[int], Awaitable[float]],
) -> tuple[float, float]:
    """Alternate short chunks of baseline and subject (the machine is small and noisy, and its
    speed drifts), so both see the same conditions; return each one's median chunk rate."""
    base: list[float] = []
    subj: list[float] = []
    for r in range(chunks):
        first, second = (baseline, subject) if r % 2 == 0 else (subject, baseline)
        a = await first(r)
        b = await second(r)
        base.append(a if first is baseline else b)
        subj.append(b if first is baseline else a)
    return statistics.median(base), statistics.median(subj)


def entry(name: str, value: float, unit: str, baseline: float | None) -> dict[str, Any]:
    ratio = round(value / baseline, 3) if baseline else None
    return {
        "name": name,
        "value": round(value, 1),
        "unit": unit,
        "baseline": round(baseline, 1) if baseline else baseline,
        "ratio": ratio,
    }


def append_results(entries: list[dict[str, Any]]) -> None:
    existing: list[dict[str, Any]] = []
    if RESULTS.exists():
        existing = json.loads(RESULTS.read_text())
    RESULTS.write_text(json.dumps(existing + entries, indent=2) + "\n")
    for e in entries:
        ratio = f"  ratio {e['ratio']:.2f}" if e["ratio"] is not None else ""
        print(
            f"{e['name']:<52} {e['value']:>10.1f} {e['unit']:<10} baseline {e['baseline']}{ratio}"
        )


class Clock:
    """First-to-last settled message of a consumer run."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.count = 0

    def tick(self, n: int = 1) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.count += n

    def rate(self) -> float:
        assert self.first is not None
        return (self.count - 1) / max(self.last - self.first, 1e-9)


async def until(done: Callable[[], bool], budget: float = 600) -> None:
    """Wait until ``done()`` (polled every 5 ms), at most ``budget`` seconds."""
    deadline = time.monotonic() + budget
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark run did not finish")
        await asyncio.sleep(0.005)


async def settled_rate(
    broker: Any, router: Any, clock: Clock, idem: Any, count: int, budget: float = 600
) -> float:
    """Run a FastStream ``broker`` until ``count`` messages were settled: counted by the plain
    handler on ``clock``, or from the middleware's stats (``idem``); their rate."""
    broker.include_router(router)
    await broker.start()
    seen = 0

    def done() -> bool:
        nonlocal seen
        if idem is None:
            return clock.count >= count
        if idem.stats.processed > seen:
            clock.tick(idem.stats.processed - seen)
            seen = idem.stats.processed
        return seen >= count

    try:
        await until(done, budget)
    finally:
        await broker.stop()
    return clock.rate()


#: wait for the machine to settle before a benchmark: at least this share of CPU time idle ...
QUIET_IDLE = 0.85
#: ... but never longer than this (a machine that never settles still gets measured)
QUIET_MAX_SECONDS = 30.0


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot (Linux), or (0, 0) where there is no /proc."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return fields[3] + fields[4], sum(fields)  # idle + iowait


async def settle() -> float:
    """Wait until a second passes with the CPUs mostly idle: the brokers and Postgres keep
    working for a while after a heavy benchmark (log flushes, checkpoints, autovacuum, the JVM's
    collector), and a 2-core machine measures that as noise in the next one. Returns the wait."""
    started = time.monotonic()
    while time.monotonic() - started < QUIET_MAX_SECONDS:
        idle0, total0 = _cpu_times()
        await asyncio.sleep(1.0)
        idle1, total1 = _cpu_times()
        if total1 == total0 or (idle1 - idle0) / (total1 - total0) >= QUIET_IDLE:
            break
    return time.monotonic() - started
