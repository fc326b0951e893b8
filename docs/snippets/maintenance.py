"""Housekeeping from code: prune past retention, park expired leases, read the
counts."""

# --8<-- [start:prune]
import os

from consumer_idem import PostgresStore

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
store = PostgresStore.from_dsn(DSN)


async def prune() -> None:
    # paced (20,000 rows/s by default): live traffic beside it keeps its speed
    report = await store.maintenance.prune(
        max_batches=100, max_rows_per_s=20_000
    )
    if (
        not report.finished
    ):  # stopped at max_batches with rows left: run again soon
        print("more to prune")
    print(report)


# --8<-- [end:prune]


async def main() -> None:
    await store.migrate()
    await prune()
    swept = await store.maintenance.sweep()  # expired leases become unknown
    stats = await store.maintenance.stats()
    print(swept)
    for scope in stats.scopes:  # what `consumer-idem stats` prints
        print(
            scope.scope, scope.completed, "completed,", scope.unknown, "unknown"
        )
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
