"""An orders API whose endpoints write through a SQLAlchemy ``AsyncSession`` bound to the
idempotency transaction: the order row and the stored response commit together, or neither.

    CONSUMER_IDEM_PG_DSN=postgresql://... uvicorn examples.orders_sqlalchemy:app --port 8000

POST /orders        {"sku": str, "qty": int}, Idempotency-Key required
                    -> 201 {"id", "sku", "qty"}: the order, written through the bound session
POST /orders/fail   the same body: writes the order through the same session, then answers
                    500; nothing it wrote persists, and a retry runs it again

A retry with the same key replays the first answer byte for byte (``Idempotent-Replayed:
true``), the same key with another body is a 422, and a duplicate arriving while the first is
in flight gets a 409 (or, once the first committed, the replay).

One pool: the store runs on the application's engine (``EnginePool``), so idempotency records
and orders share its connections. Start-up migrates the store and creates ``sa_orders``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import BigInteger, Identity, Integer, Text, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumer_idem.http import IdempotencyMiddleware, idempotent
from consumer_idem.sqlalchemy import engine_store
from consumer_idem.sqlalchemy.fastapi import IdempotentSession

DEFAULT_DSN = "postgresql://postgres:postgres@127.0.0.1:5432/postgres"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_orders"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    sku: Mapped[str] = mapped_column(Text)
    qty: Mapped[int] = mapped_column(Integer)


class OrderIn(BaseModel):
    sku: str = Field(min_length=1, max_length=64)
    qty: int = Field(gt=0, le=10_000)


class OrderOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    sku: str
    qty: int


def engine_for(dsn: str) -> AsyncEngine:
    """The application's engine, on the asyncpg driver (the store needs it)."""
    return create_async_engine(make_url(dsn).set(drivername="postgresql+asyncpg"))


def create_app(dsn: str | None = None) -> FastAPI:
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_for(dsn or os.environ.get("CONSUMER_IDEM_PG_DSN", DEFAULT_DSN))
        store = engine_store(engine, schema=os.environ.get("CONSUMER_IDEM_SCHEMA", "consumer_idem"))
        await store.migrate()
        async with engine.begin() as conn:  # one starter at a time creates the table
            await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('sa_orders'))"))
            await conn.run_sync(Base.metadata.create_all)
        holder["store"] = store
        yield
        await engine.dispose()

    app = FastAPI(title="consumer-idem orders (SQLAlchemy) example", lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        store=lambda: holder["store"],
        # keys never cross callers: a real API would name the authenticated customer here
        caller=lambda conn: conn.headers.get("x-tenant", "public"),
    )

    @app.post("/orders", status_code=201, response_model=OrderOut)
    @idempotent(required=True)
    async def create_order(
        order: OrderIn,
        session: IdempotentSession,
        idempotency_key: str = Header(alias="Idempotency-Key", max_length=300),
    ) -> Order:
        row = Order(sku=order.sku, qty=order.qty)
        session.add(row)
        # a flush inside an idempotent request: the middleware commits the order together
        # with the stored 201, after this returns (and never if the response is a 5xx)
        await session.commit()
        return row

    @app.post("/orders/fail", status_code=201, response_model=OrderOut)
    @idempotent(required=True)
    async def create_order_then_fail(
        order: OrderIn,
        session: IdempotentSession,
        idempotency_key: str = Header(alias="Idempotency-Key", max_length=300),
    ) -> JSONResponse:
        row = Order(sku=order.sku, qty=order.qty)
        session.add(row)
        await session.flush()  # the row exists, in the request's transaction only
        return JSONResponse({"error": "failed after writing", "order_id": row.id}, status_code=500)

    return app


app = create_app()
