"""Postgres CPU per idempotent unit: ``run_transactional`` with one effect INSERT against the
same INSERT in a plain transaction, the effect table with a primary key (as real ones have).

Clients are P worker processes of T asyncio tasks each, one connection per task, kept for the
whole run (connecting is not counted). Rounds of a few seconds alternate plain and idempotent,
each round starting with the side the round before ended with; the server's CPU over a round
(`benchmarks.pg_cpu`, live and exited processes, the WAL writer and the rest included) is
divided by the units done in it. Medians of the rounds.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import asyncpg

from benchmarks.pg_cpu import CpuMeter, postmaster_of

EFFECT = "INSERT INTO bench_effects_pk (id, customer_id, amount_cents) VALUES ($1, $2, $3)"
TABLE = "CREATE TABLE bench_effects_pk (id text PRIMARY KEY, customer_id text, amount_cents bigint)"


async def _serve(dsn: str, tasks: int, name: str, pipe: Connection) -> None:
    from consumer_idem import PostgresStore, run_transactional

    pool = await asyncpg.create_pool(dsn, min_size=tasks, max_size=tasks)
    assert pool is not None
    store = PostgresStore(pool)
    loop = asyncio.get_running_loop()
    try:
        while True:
            order = await loop.run_in_executor(None, pipe.recv)
            if order is None:
                return
            mode, seconds, tag = order
            count = 0

            async def work(w: int, stop: float, mode: str = mode, tag: str = tag) -> None:
                nonlocal count
                i = 0
                while time.perf_counter() < stop:
                    i += 1
                    key = f"{name}-{mode}-{tag}-{w}-{i}"
                    if mode == "plain":
                        async with pool.acquire() as conn, conn.transaction():
                            await conn.execute(EFFECT, key, "c1", 100)
                    else:

                        async def effect(conn: asyncpg.Connection, key: str = key) -> Any:
                            await conn.execute(EFFECT, key, "c1", 100)
                            # "idem+result": a result stored with the claim (an UPDATE of it)
                            return {"ok": 1} if mode == "idem+result" else None

                        await run_transactional(store, f"cpu-{tag}", key, "v1:jcs:x", effect)
                    count += 1

            stop = time.perf_counter() + seconds
            await asyncio.gather(*(work(w, stop) for w in range(tasks)))
            pipe.send(count)
    finally:
        await pool.close()


def _worker(
    dsn: str, tasks: int, name: str, pipe: Connection, setup: Callable[[], None] | None
) -> None:
    if setup is not None:
        setup()
    asyncio.run(_serve(dsn, tasks, name, pipe))


class Clients:
    """P worker processes of T tasks each, run round by round. ``setup``: a module-level
    function each worker calls first (`benchmarks.cpu_variants` alters the claim with it)."""

    def __init__(
        self, dsn: str, procs: int, tasks: int, setup: Callable[[], None] | None = None
    ) -> None:
        ctx = mp.get_context("spawn")  # no event loop or connection inherited
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        run = uuid.uuid4().hex[:8]  # keys unique across runs on one table
        for p in range(procs):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(dsn, tasks, f"{run}p{p}", theirs, setup), daemon=True
            )
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    async def round(self, mode: str, seconds: float, tag: str) -> int:
        for pipe in self.pipes:
            pipe.send((mode, seconds, tag))
        loop = asyncio.get_running_loop()
        counts = await asyncio.gather(*(loop.run_in_executor(None, p.recv) for p in self.pipes))
        return sum(counts)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)


async def cpu_per_unit(
    dsn: str, procs: int, tasks: int, rounds: int = 5, seconds: float = 3.0
) -> tuple[float, float, list[float]]:
    """(plain µs, idempotent µs, the ratio of each round) of Postgres CPU per unit."""
    meter = CpuMeter(await postmaster_of(dsn))
    clients = Clients(dsn, procs, tasks)
    plain: list[float] = []
    idem: list[float] = []
    try:
        for mode in ("plain", "idem"):  # warm-up: connections, prepared statements, pages
            await clients.round(mode, 1.0, f"w{mode}")
        for r in range(rounds):
            order = ("plain", "idem") if r % 2 == 0 else ("idem", "plain")
            for mode in order:
                meter.start()
                units = await clients.round(mode, seconds, f"r{r}")
                (plain if mode == "plain" else idem).append(meter.stop(units).pg_us)
    finally:
        clients.close()
    ratios = [round(i / p, 2) for i, p in zip(idem, plain, strict=True)]
    return statistics.median(plain), statistics.median(idem), ratios
