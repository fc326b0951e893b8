"""Logging: the library's records on stderr, one line each, with their scope
and key."""

# --8<-- [start:config]
import logging.config

logging.config.dictConfig(
    {
        "version": 1,
        "disable_existing_loggers": False,  # keep the loggers made at import
        "formatters": {
            "line": {
                "format": "%(asctime)s %(levelname)s %(name)s: %(message)s"
            },
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "line"},
        },
        "loggers": {
            # every logger of the library is a child of this one
            "consumer_idem": {"handlers": ["stderr"], "level": "INFO"},
            # one part louder or quieter, e.g. the Kafka runner's rebalances
            "consumer_idem.transports.kafka": {"level": "WARNING"},
        },
    }
)
# --8<-- [end:config]


async def main() -> None:
    """A message whose key is reused for another payload: logged at INFO by
    consumer_idem.consumer, with the scope and key."""
    import os
    import uuid

    import asyncpg

    from consumer_idem import (
        ConsumerMessage,
        PostgresStore,
        idempotent_consumer,
    )

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("consumer_idem").addHandler(Keep())
    dsn = os.environ.get(
        "CONSUMER_IDEM_PG_DSN",
        "postgresql://postgres:postgres@127.0.0.1/postgres",
    )
    async with PostgresStore.from_dsn(dsn) as store:
        await store.migrate()

        @idempotent_consumer(store, scope="docs.logged")
        async def handle(
            message: ConsumerMessage, conn: asyncpg.Connection
        ) -> None:
            pass

        key = {"idempotency-key": uuid.uuid4().hex.encode()}
        await handle.process(ConsumerMessage(b'{"cents": 1}', key))
        await handle.process(ConsumerMessage(b'{"cents": 2}', key))  # misuse
    logged = [r for r in records if r.name == "consumer_idem.consumer"]
    assert logged and logged[-1].levelno == logging.INFO, records
    assert getattr(logged[-1], "scope", None) == "docs.logged"


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
