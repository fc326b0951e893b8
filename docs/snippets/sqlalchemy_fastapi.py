"""ORM writes in the idempotency transaction of an HTTP request (FastAPI)."""

# --8<-- [start:app]
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from sqlalchemy import BigInteger, Identity, Integer, Text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumer_idem.http import IdempotencyMiddleware, idempotent
from consumer_idem.sqlalchemy import engine_store
from consumer_idem.sqlalchemy.fastapi import IdempotentSession

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_docs_orders"
    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    sku: Mapped[str] = mapped_column(Text)
    qty: Mapped[int] = mapped_column(Integer)


class OrderIn(BaseModel):
    sku: str
    qty: int


class OrderOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    sku: str
    qty: int


engine = create_async_engine(make_url(DSN).set(drivername="postgresql+asyncpg"))
store = engine_store(engine)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await store.migrate()
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)
app.add_middleware(
    IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-tenant"]
)


@app.post("/orders", status_code=201, response_model=OrderOut)
@idempotent(required=True)  # the session needs the key: no key, no transaction
async def create_order(order: OrderIn, session: IdempotentSession) -> Order:
    row = Order(sku=order.sku, qty=order.qty)
    session.add(row)
    await (
        session.commit()
    )  # a flush: committed with the stored 201, after return
    return row


# --8<-- [end:app]


async def main() -> None:
    import uuid

    import httpx

    headers = {
        "Idempotency-Key": f"o-{uuid.uuid4().hex[:8]}",
        "x-tenant": "t-1",
    }
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://shop"
        ) as client:
            first = await client.post(
                "/orders", json={"sku": "B", "qty": 3}, headers=headers
            )
            retry = await client.post(
                "/orders", json={"sku": "B", "qty": 3}, headers=headers
            )
    print(first.status_code, first.json(), retry.headers["idempotent-replayed"])
    assert retry.content == first.content


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
