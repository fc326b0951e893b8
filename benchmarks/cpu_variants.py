"""Postgres CPU per idempotent unit on altered copies of the store's schema, in one run.

``python -m benchmarks.cpu_variants 4x16 [rounds] [seconds] [name,...]``: a scratch database per
variant (the current schema, then each change of `VARIANTS` made by hand after the migrations, or a
change of the claim each client process makes first), the plain unit on the first one; every
round runs each side once, each round starting with the next side; medians, each as a ratio to
the plain unit. Only to decide whether a change is worth a migration: the changes here drop
what the library needs. Each variant keeps its clients' connections open, so the server needs
``max_connections`` above 10 x P x T (a server of its own: run it with ``CONSUMER_IDEM_PG_DSN``
pointing there).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack

import asyncpg

from benchmarks.common import scratch_database
from benchmarks.pg_cpu import CpuMeter, postmaster_of
from benchmarks.store_cpu import TABLE, Clients
from consumer_idem import PostgresStore

RECORDS = "consumer_idem.idempotency_records"
NO_EXPIRY_BTREE = [f"DROP INDEX {RECORDS}_expiry"]
NO_PARTIAL_INDEXES = [f"DROP INDEX {RECORDS}_leases, {RECORDS}_listing, {RECORDS}_reconcile_due"]
#: the store as version 11 left it: the status and result kind checked by CHECK constraints
CHECKS = [
    f"ALTER TABLE {RECORDS} ALTER COLUMN status TYPE text, ALTER COLUMN result_kind TYPE text,"
    " ADD CONSTRAINT idempotency_records_status_check CHECK (status IN ('in_progress',"
    " 'completed', 'failed_retryable', 'unknown', 'expired')),"
    " ADD CONSTRAINT idempotency_records_result_kind_check"
    " CHECK (result_kind IN ('success', 'domain_error'))"
]
#: nothing checks a record's values
NO_CHECKS = [
    f"ALTER TABLE {RECORDS} ALTER COLUMN status TYPE text, ALTER COLUMN result_kind TYPE text,"
    " DROP CONSTRAINT idempotency_records_check"
]
C_COLLATION = [
    f'ALTER TABLE {RECORDS} ALTER COLUMN scope TYPE text COLLATE "C",'
    ' ALTER COLUMN key TYPE text COLLATE "C"'
]


def plain_claim() -> None:
    """The fast path's claim as a plain INSERT, without ON CONFLICT's speculative insertion
    (a pre-check of the primary key, then a confirmation record). Every key of these runs is
    new, so no claim conflicts and the unit does the same work otherwise."""
    from consumer_idem.stores.postgres.fast_path import FastPath

    original = FastPath._claim_sql

    def claim_sql(self: FastPath, *args: str) -> str:
        return original(self, *args).replace(" ON CONFLICT (scope, key) DO NOTHING", "")

    FastPath._claim_sql = claim_sql  # type: ignore[method-assign]


#: name: (schema changes made after the migrations, a setup each client process runs first)
VARIANTS: dict[str, tuple[list[str], Callable[[], None] | None]] = {
    "current": ([], None),
    "check_constraints": (CHECKS, None),
    "plain_claim": ([], plain_claim),
    "no_expiry_btree": (NO_EXPIRY_BTREE, None),
    "brin_expiry": (
        [*NO_EXPIRY_BTREE, f"CREATE INDEX ON {RECORDS} USING brin (expires_at)"],
        None,
    ),
    "no_partial_indexes": (NO_PARTIAL_INDEXES, None),
    "no_checks": (NO_CHECKS, None),
    "c_collation": (C_COLLATION, None),
    # all of the above at once: what the row costs with nothing but its heap tuple and key
    "lean": ([*NO_EXPIRY_BTREE, *NO_PARTIAL_INDEXES, *NO_CHECKS, *C_COLLATION], plain_claim),
}


async def _prepare(dsn: str, changes: list[str]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(TABLE)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        assert pool is not None
        await PostgresStore(pool).migrate()
        await pool.close()
        for sql in changes:
            await conn.execute(sql)
    finally:
        await conn.close()


async def main(level: str, rounds: int, seconds: float, names: list[str]) -> None:
    procs, tasks = map(int, level.split("x"))
    if "current" not in names:
        names = ["current", *names]  # the plain unit runs on the current schema
    async with AsyncExitStack() as stack:
        dsns = {}
        for name in names:
            dsns[name] = await stack.enter_async_context(scratch_database())
            await _prepare(dsns[name], VARIANTS[name][0])
        meter = CpuMeter(await postmaster_of(dsns["current"]))
        clients = {
            name: Clients(dsn, procs, tasks, VARIANTS[name][1]) for name, dsn in dsns.items()
        }
        try:
            sides = [("plain", "current")] + [("idem", name) for name in names]
            for mode, name in sides:  # warm-up
                await clients[name].round(mode, 1.0, f"w{mode}")
            cpu: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
            for r in range(rounds):
                for k in range(len(sides)):
                    mode, name = sides[(r + k) % len(sides)]
                    meter.start()
                    units = await clients[name].round(mode, seconds, f"r{r}")
                    cpu[(mode, name)].append(meter.stop(units).pg_us)
        finally:
            for c in clients.values():
                c.close()
    plain = statistics.median(cpu[("plain", "current")])
    out: dict[str, object] = {"level": level, "plain_us": round(plain)}
    for name in names:
        us = statistics.median(cpu[("idem", name)])
        out[name] = {"us": round(us), "ratio": round(us / plain, 2)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(
        main(
            args[0],
            int(args[1]) if len(args) > 1 else 7,
            float(args[2]) if len(args) > 2 else 2.0,
            args[3].split(",") if len(args) > 3 else list(VARIANTS),
        )
    )
