"""Housekeeping from code: prune past retention, park expired leases, read the counts."""

import asyncio
import os

import asyncpg

from consumer_idem import PostgresStore

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    # --8<-- [start:prune]
    report = await store.maintenance.prune(batch_size=1000, max_batches=100)
    if not report.finished:  # stopped at max_batches with rows left: run again soon
        print("more to prune")
    # --8<-- [end:prune]
    swept = await store.maintenance.sweep()  # expired leases become unknown
    stats = await store.maintenance.stats()
    print(report, swept, sep="\n")
    for scope in stats.scopes:  # what `consumer-idem stats` prints
        print(scope.scope, scope.completed, "completed,", scope.unknown, "unknown")
    await pool.close()


asyncio.run(main())
