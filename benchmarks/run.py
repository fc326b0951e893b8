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

from benchmarks.common import RESULTS, append_results, settle

BENCHMARKS = [
    "store",
    "consumers",
    "redis",
    "http",
    "sqlalchemy",
    "scale",
    "peer",
    "outbox",
    "faststream_nats",
    "faststream_confluent",
    "faststream_redis",
]


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
