"""ORM writes in the idempotency transaction: a consumer handler that takes a
session."""

# --8<-- [start:consumer]
import os
from typing import Any

from sqlalchemy import Integer, Text, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumer_idem import ConsumerMessage, header, idempotent_consumer
from consumer_idem.sqlalchemy import engine_store, with_session

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


class Base(DeclarativeBase):
    pass


class LedgerEntry(Base):
    __tablename__ = "sa_ledger"
    payment_id: Mapped[str] = mapped_column(Text, primary_key=True)
    amount_cents: Mapped[int] = mapped_column(Integer)


URL = make_url(DSN).set(drivername="postgresql+asyncpg")
engine = create_async_engine(URL)
# one pool: the store checks connections out of the engine's
store = engine_store(engine)


@idempotent_consumer(
    store, scope="docs.sa.ledger", key=header("idempotency-key")
)
@with_session
async def record(
    message: ConsumerMessage, session: AsyncSession
) -> dict[str, Any]:
    session.add(LedgerEntry(**message.json()))
    # flushed, then committed with the record
    return {"recorded": message.json()["payment_id"]}


# --8<-- [end:consumer]


async def main() -> None:
    import json
    import uuid

    await store.migrate()
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)

    pid = f"pay-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"payment_id": pid, "amount_cents": 700}).encode()
    for _ in range(3):
        verdict = await record.process(
            ConsumerMessage(body, {"idempotency-key": pid.encode()})
        )
        print(
            verdict.action,
            "duplicate" if verdict.duplicate else "executed",
            verdict.result,
        )
    async with AsyncSession(engine) as session:
        rows = await session.scalar(
            select(func.count()).where(LedgerEntry.payment_id == pid)
        )
    assert rows == 1
    await engine.dispose()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
