"""Idempotency-Key on a FastAPI app: serve it with `uvicorn http_app:app`."""

# --8<-- [start:app]
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from pydantic import BaseModel

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, idempotent, transaction_of

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
store = PostgresStore.from_dsn(DSN)  # its pool opens in the lifespan below


class OrderIn(BaseModel):
    sku: str
    qty: int


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with store:  # opens the pool; closes it at shutdown
        await store.migrate()
        await store.pool.execute(
            "CREATE TABLE IF NOT EXISTS http_orders"
            " (id text, sku text, qty int)"
        )
        yield


app = FastAPI(lifespan=lifespan)
app.add_middleware(
    IdempotencyMiddleware,
    store=store,
    # whose keys these are
    caller=lambda conn: conn.headers.get("x-merchant-id"),
)


@app.post("/orders", status_code=201)
@idempotent(required=True)  # transactional: the writes commit with the record
async def create_order(order: OrderIn, request: Request) -> dict[str, str]:
    order_id = f"ord_{uuid.uuid4().hex[:8]}"
    await transaction_of(request).execute(
        "INSERT INTO http_orders VALUES ($1, $2, $3)",
        order_id,
        order.sku,
        order.qty,
    )
    return {"order_id": order_id}


# --8<-- [end:app]


# --8<-- [start:requests]
async def try_it() -> None:
    """Requests through the app in-process, as uvicorn would serve them
    (`pip install httpx`)."""
    import httpx

    key = f'"order-{uuid.uuid4().hex[:8]}"'  # an RFC 8941 string, or a token
    headers = {"Idempotency-Key": key, "x-merchant-id": "m-1"}
    order = {"sku": "A", "qty": 1}
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=transport, base_url="http://shop"
        ) as client,
    ):
        first = await client.post("/orders", json=order, headers=headers)
        retry = await client.post("/orders", json=order, headers=headers)
        assert (first.status_code, retry.status_code) == (201, 201)
        assert retry.content == first.content  # byte for byte
        assert retry.headers["idempotent-replayed"] == "true"

        # the same key for another request
        other = {"sku": "A", "qty": 2}
        reused = await client.post("/orders", json=other, headers=headers)
        assert reused.status_code == 422
        problem = "urn:consumer-idem:problem:idempotency-key-reused"
        assert reused.json()["type"] == problem

        missing = await client.post("/orders", json=order)
        assert missing.status_code == 400  # required=True: no key, no run

        # bodies are read whole, up to 1 MiB (max_body= on the middleware)
        big = {"sku": "A" * (1 << 20), "qty": 1}
        too_large = await client.post(
            "/orders", json=big, headers={**headers, "Idempotency-Key": "big-1"}
        )
        assert too_large.status_code == 413
    print(first.status_code, first.json(), retry.headers["idempotent-replayed"])


# --8<-- [end:requests]


if __name__ == "__main__":
    import asyncio

    asyncio.run(try_it())
