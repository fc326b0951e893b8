"""Where PostgreSQL spends the idempotent unit's extra CPU, sampled with ``perf``.

``python -m benchmarks.pg_perf 4x16 [seconds]`` (needs ``perf`` and the right to sample the
server's processes: run it on a PostgreSQL of your own, as the same user or root): the clients
of `benchmarks.store_cpu` run the plain unit, then the idempotent one, while ``perf record``
samples their backends; each sample is put under the first of `PLACES` found on its stack, and
the microseconds per unit of each side are printed. Not part of ``make bench``.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

import asyncpg

from benchmarks.common import scratch_database
from benchmarks.cpu_variants import _prepare
from benchmarks.store_cpu import Clients

#: (a function on the stack, where its sample is counted), first match wins; the executor's
#: places count for the claim and the check only inside ExecuteQuery (the library's EXECUTEs)
PLACES = [
    ("ExecInsertIndexTuples", "index entries"),
    ("ExecCheckIndexConstraints", "ON CONFLICT look-up"),
    ("ExecConstraints", "CHECK constraints"),
    ("heap_insert", "heap tuple"),
    ("standard_ExecutorStart", "executor start-up"),
    ("standard_ExecutorRun", "execution, other"),
    ("standard_ExecutorEnd", "executor end"),
    ("ExecuteQuery", "EXECUTE: parameters, plan cache, portal"),
    ("pg_parse_query", "parsing"),
    ("CommitTransactionCommand", "commit"),
    ("__send", "send"),
    ("pq_getbyte", "receive"),
]
_EXECUTOR = {name for name, _ in PLACES[:7]}


def _place(stack: set[str]) -> str:
    for name, place in PLACES:
        if name in stack:
            if name in _EXECUTOR and "ExecuteQuery" not in stack:
                return f"other statements: {place}"
            return place
    return "other"


def places(data: Path, units: int) -> dict[str, float]:
    """µs per unit of each place in a ``perf record -g`` file."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "period,ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: collections.Counter[str] = collections.Counter()
    for sample in script.split("\n\n"):
        lines = [line for line in sample.splitlines() if line.strip()]
        if not lines:
            continue
        stack = {line.split(None, 1)[-1].split("+")[0] for line in lines[1:]}
        found[_place(stack)] += int(lines[0].split()[0])
    return {place: ns / units / 1000 for place, ns in found.items()}


async def main(level: str, seconds: float) -> None:
    procs, tasks = map(int, level.split("x"))
    async with scratch_database() as dsn:
        await _prepare(dsn, [])
        clients = Clients(dsn, procs, tasks)
        try:
            for mode in ("plain", "idem"):  # warm-up: connections, prepared statements
                await clients.round(mode, 1.0, f"w{mode}")
            conn = await asyncpg.connect(dsn)
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )
            await conn.close()
            sides = {}
            with tempfile.TemporaryDirectory() as tmp:
                for mode in ("plain", "idem"):
                    data = Path(tmp) / f"{mode}.data"
                    pid_list = ",".join(str(r["pid"]) for r in pids)
                    perf = await asyncio.create_subprocess_exec(
                        *("perf", "record", "-F", "4999", "-g", "-o", str(data), "-p", pid_list),
                        stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL,
                    )
                    await asyncio.sleep(0.5)  # perf attached
                    units = await clients.round(mode, seconds, f"p{mode}")
                    perf.send_signal(2)
                    await perf.wait()
                    sides[mode] = places(data, units)
        finally:
            clients.close()
    plain, idem = sides["plain"], sides["idem"]
    for place in sorted(set(plain) | set(idem), key=lambda p: plain.get(p, 0) - idem.get(p, 0)):
        added = idem.get(place, 0) - plain.get(place, 0)
        print(f"{added:7.1f} {plain.get(place, 0):7.1f} {idem.get(place, 0):7.1f}  {place}")
    totals = f"plain {sum(plain.values()):.0f}, idempotent {sum(idem.values()):.0f}"
    print(f"total µs per unit: {totals}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 6.0))
