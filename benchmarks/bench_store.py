"""Transactional mode (claim + one effect row + complete, one commit) against the same effect
INSERT committed without the store, same run, same database: rates, then Postgres CPU per unit
(`benchmarks.store_cpu`; lower is better, so a ratio under 1 is a gain there)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from benchmarks.common import entry, interleaved, rate, scratch_database, settle
from benchmarks.store_cpu import TABLE, cpu_per_unit
from consumer_idem import PostgresStore, run_transactional

EFFECT = "INSERT INTO bench_effects (id, customer_id, amount_cents) VALUES ($1, $2, $3)"


async def run(per_chunk: int = 300, chunks: int = 12) -> list[dict[str, Any]]:
    results = []
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=16, max_size=16)
        assert pool is not None
        await pool.execute(
            "CREATE TABLE bench_effects (id text, customer_id text, amount_cents bigint)"
        )
        store = PostgresStore(pool)
        await store.migrate()
        # (name suffix, concurrency, what the handler returns: None = nothing stored)
        variants = [("c1", 1, None), ("c1.with_result", 1, {"ok": 1}), ("c16", 16, None)]
        for suffix, concurrency, returned in variants:
            total = per_chunk * (4 if concurrency > 1 else 1)

            async def raw(r: int, total: int = total, concurrency: int = concurrency) -> float:
                async def op(i: int) -> None:
                    async with pool.acquire() as conn, conn.transaction():
                        await conn.execute(EFFECT, f"raw-{r}-{i}", "c1", 100)

                return await rate(op, total, concurrency)

            async def idem(
                r: int, total: int = total, concurrency: int = concurrency, returned: Any = returned
            ) -> float:
                scope = f"bench-{uuid.uuid4().hex[:6]}"

                async def op(i: int) -> None:
                    async def handler(conn: asyncpg.Connection) -> Any:
                        await conn.execute(EFFECT, f"{scope}-{i}", "c1", 100)
                        return returned

                    await run_transactional(store, scope, f"key-{i}", "v1:jcs:x", handler)

                return await rate(op, total, concurrency)

            await raw(-1)  # warm-up: connections, prepared statements, table pages
            await idem(-1)
            base, subject = await interleaved(chunks, raw, idem)
            results.append(
                entry(f"store.transactional.reservations_per_s.{suffix}", subject, "ops/s", base)
            )
        await pool.execute(TABLE)
        await pool.close()
        # Postgres CPU per unit: (suffix, worker processes, tasks each)
        for suffix, procs, tasks in (("c1", 1, 1), ("c16", 1, 16), ("c64", 4, 16)):
            await settle()
            plain_us, idem_us, ratios = await cpu_per_unit(dsn, procs, tasks)
            print(f"   pg cpu per unit {suffix}: ratios per round {ratios}", flush=True)
            results.append(entry(f"store.pg_cpu_per_unit.{suffix}", idem_us, "us/unit", plain_us))
    return results
