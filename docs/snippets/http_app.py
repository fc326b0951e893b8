"""Idempotency-Key on a FastAPI app: serve it with `uvicorn http_app:app`."""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, idempotent, transaction_of

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")


# --8<-- [start:app]
class OrderIn(BaseModel):
    sku: str
    qty: int


stores: list[PostgresStore] = []


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool = await asyncpg.create_pool(DSN)
    stores.append(PostgresStore(pool))
    await stores[0].migrate()
    await pool.execute("CREATE TABLE IF NOT EXISTS http_orders (id text, sku text, qty int)")
    yield
    await pool.close()


app = FastAPI(lifespan=lifespan)
app.add_middleware(
    IdempotencyMiddleware,
    store=lambda: stores[0],  # the store, or a function returning it (made at start-up)
    caller=lambda conn: conn.headers.get("x-merchant-id"),  # whose keys these are
)


@app.post("/orders", status_code=201)
@idempotent(required=True)  # transactional (default): the writes commit with the record
async def create_order(order: OrderIn, request: Request) -> dict[str, str]:
    order_id = f"ord_{uuid.uuid4().hex[:8]}"
    await transaction_of(request).execute(
        "INSERT INTO http_orders VALUES ($1, $2, $3)", order_id, order.sku, order.qty
    )
    return {"order_id": order_id}


# --8<-- [end:app]


async def main() -> None:
    """Requests through the app in-process (what uvicorn would serve)."""
    key = f'"order-{uuid.uuid4().hex[:8]}"'  # an RFC 8941 string, or a bare token
    headers = {"Idempotency-Key": key, "x-merchant-id": "m-1"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            # --8<-- [start:requests]
            first = await client.post("/orders", json={"sku": "A", "qty": 1}, headers=headers)
            retry = await client.post("/orders", json={"sku": "A", "qty": 1}, headers=headers)
            assert (first.status_code, retry.status_code) == (201, 201)
            assert retry.content == first.content  # byte for byte
            assert retry.headers["idempotent-replayed"] == "true"

            other = await client.post("/orders", json={"sku": "A", "qty": 2}, headers=headers)
            assert other.status_code == 422  # the same key for another request
            assert other.json()["type"] == "urn:consumer-idem:problem:idempotency-key-reused"

            missing = await client.post("/orders", json={"sku": "A", "qty": 1})
            assert missing.status_code == 400  # required=True: no key, no run

            big = {"sku": "A" * (1 << 20), "qty": 1}  # bodies are read whole, up to 1 MiB
            too_large = await client.post(
                "/orders", json=big, headers={**headers, "Idempotency-Key": "big-1"}
            )
            assert too_large.status_code == 413  # max_body= on the middleware to change it
            # --8<-- [end:requests]
            print(first.status_code, first.json(), retry.headers["idempotent-replayed"])


if __name__ == "__main__":
    asyncio.run(main())
