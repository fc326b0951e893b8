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
    # paced (20,000 rows/s by default) so that live traffic beside it keeps its speed
    report = await store.maintenance.prune(max_batches=100, max_rows_per_s=20_000)
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
