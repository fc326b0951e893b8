"""Store scale on a many-core machine: ``run_transactional`` with one effect INSERT against
the same INSERT committed raw, alternating rounds, N processes x C tasks each, one PostgreSQL.
Prints one JSON line per level: the rates, their ratio, and the CPU per unit of the
PostgreSQL server (`benchmarks.pg_cpu`: live and exited backends) and of the clients.

``DSN=... PK=1 SECS=3 ROUNDS=3 python benchmarks/store_scale.py 1x1 2x8 8x8 16x8``; run by
``benchmarks/many_cores.sh`` on a machine where PostgreSQL runs nothing else.
"""

import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

import asyncpg

from benchmarks.pg_cpu import postmaster_of, server_seconds
from consumer_idem import PostgresStore, run_transactional

EFFECT = "INSERT INTO bench_effects (id, customer_id, amount_cents) VALUES ($1, $2, $3)"
DSN = os.environ["DSN"]


async def one_proc(mode: str, conc: int, seconds: float, tag: str) -> tuple[int, float]:
    pool = await asyncpg.create_pool(DSN, min_size=conc, max_size=conc)
    store = PostgresStore(pool)
    count = 0
    scope = f"s{tag}"

    async def w(wi: int, stop: float, phase: str = "m") -> None:
        nonlocal count
        i = 0
        while time.perf_counter() < stop:
            i += 1
            key = f"{tag}{phase}-{wi}-{i}"
            if mode == "raw":
                async with pool.acquire() as conn, conn.transaction():
                    await conn.execute(EFFECT, key, "c1", 100)
            else:

                async def h(conn: asyncpg.Connection, key: str = key) -> None:
                    await conn.execute(EFFECT, key, "c1", 100)

                await run_transactional(store, scope, key, "v1:jcs:x", h)
            count += 1

    # warm-up (connections, prepared statements) not counted
    await asyncio.gather(*(w(i, time.perf_counter() + 0.5, "w") for i in range(conc)))
    count = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(w(i, t0 + seconds) for i in range(conc)))
    el = time.perf_counter() - t0
    await pool.close()
    return count, el


def child(args: tuple[str, int, float, str]) -> tuple[int, float]:
    return asyncio.run(one_proc(*args))


CPU = {}
#: the server's postmaster: its CPU and its children's (`benchmarks.pg_cpu`)
POSTMASTER = 0


def measure(mode: str, procs: int, conc: int, seconds: float, rnd: int) -> float:
    import resource

    t0 = server_seconds(POSTMASTER)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = mp.get_context("fork").Pool(procs)
    res = p.map(
        child, [(mode, conc, seconds, f"{mode}{procs}x{conc}r{rnd}p{i}") for i in range(procs)]
    )
    p.close()
    p.join()
    t1 = server_seconds(POSTMASTER)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = sum(c for c, _ in res)
    CPU.setdefault(mode, []).append(
        (
            round((t1 - t0) / max(n, 1) * 1e6),
            round(((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / max(n, 1) * 1e6),
        )
    )
    return n / max(e for _, e in res)


async def setup() -> None:
    conn = await asyncpg.connect(DSN)
    await conn.execute(
        "DROP TABLE IF EXISTS bench_effects; CREATE TABLE bench_effects (id text"
        + (" PRIMARY KEY" if os.environ.get("PK") else "")
        + ", customer_id text, amount_cents bigint)"
    )
    await conn.close()
    pool = await asyncpg.create_pool(DSN, min_size=1, max_size=2)
    await PostgresStore(pool).migrate()
    await pool.close()


if __name__ == "__main__":
    asyncio.run(setup())
    POSTMASTER = asyncio.run(postmaster_of(DSN))
    levels = [(1, 1), (1, 16), (4, 4), (8, 8), (16, 8)]
    if len(sys.argv) > 1:
        levels = [tuple(map(int, x.split("x"))) for x in sys.argv[1:]]
    secs, rounds = float(os.environ.get("SECS", "4")), int(os.environ.get("ROUNDS", "3"))
    for procs, conc in levels:
        raw, idem = [], []
        for r in range(rounds):
            order = ("raw", "idem") if r % 2 == 0 else ("idem", "raw")
            for m in order:
                (raw if m == "raw" else idem).append(measure(m, procs, conc, secs, r))
        ratios = sorted(i / b for i, b in zip(idem, raw, strict=True))
        print(
            json.dumps(
                {
                    "procs": procs,
                    "conc_per_proc": conc,
                    "clients": procs * conc,
                    "raw_ops_s": [round(x) for x in raw],
                    "idem_ops_s": [round(x) for x in idem],
                    "ratio_median": round(ratios[len(ratios) // 2], 3),
                    "cpu_us_per_op_pg_py": {k: v for k, v in CPU.items()},
                    "pk": bool(os.environ.get("PK")),
                }
            ),
            flush=True,
        )
        CPU.clear()
