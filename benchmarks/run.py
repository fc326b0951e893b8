"""`make bench`: every benchmark, each against a baseline measured in the same run.

Results are appended to benchmarks/results.json as {"name", "value", "unit", "baseline", "ratio"}.
Pass benchmark names to run only some: `python -m benchmarks.run store`.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from typing import Any

from benchmarks.common import append_results

BENCHMARKS = ["store", "consumers", "redis", "http", "sqlalchemy", "scale", "peer", "outbox"]


async def main(names: list[str]) -> None:
    entries: list[dict[str, Any]] = []
    for name in names or BENCHMARKS:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        print(f"== {name}", flush=True)
        entries += await module.run()
    append_results(entries)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
