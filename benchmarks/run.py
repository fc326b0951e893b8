"""`make bench`: every benchmark, each against a baseline measured in the same run.

Results go to benchmarks/results.json as {"name", "value", "unit", "baseline", "ratio"}: a full
run writes it anew; `python -m benchmarks.run store` runs only the benchmarks named and appends
their entries. Each benchmark runs in a Python process of its own, so none measures the heap,
the collector or the event loop another one left behind (the asyncio side of a comparison
allocates more than a synchronous peer, and paid for the garbage of the benchmarks before it).
"""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, append_results

BENCHMARKS = ["store", "consumers", "redis", "http", "sqlalchemy", "scale", "peer", "outbox"]


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


async def one(name: str) -> None:
    """Run one benchmark in this process and append its entries."""
    module = importlib.import_module(f"benchmarks.bench_{name}")
    append_results(await module.run())


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"no such benchmark: {', '.join(unknown)} (known: {BENCHMARKS})")
    if not names:
        RESULTS.unlink(missing_ok=True)  # a full run: one run's entries, nothing older
    for name in names or BENCHMARKS:
        waited = asyncio.run(settle())
        print(f"== {name} (after {waited:.0f} s for the machine to settle)", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.run", "--one", name], check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        asyncio.run(one(sys.argv[2]))
    else:
        main(sys.argv[1:])
