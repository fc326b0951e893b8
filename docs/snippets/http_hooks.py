"""Hooks on an HTTP route: count real executions, mark replayed responses."""

# --8<-- [start:hooks]
import asyncio
import os
import uuid
from collections import Counter

import httpx
from fastapi import FastAPI
from pydantic import BaseModel

from consumer_idem import PostgresStore
from consumer_idem.http import (
    IdempotencyMiddleware,
    RequestOutcome,
    idempotent,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
store = PostgresStore.from_dsn(DSN)
runs: Counter[str] = Counter()


def executed(outcome: RequestOutcome) -> None:
    runs[outcome.route] += 1  # the endpoint ran, its response recorded


def replayed(outcome: RequestOutcome) -> None:
    # a duplicate answered from the record: say so in a header of yours
    outcome.set_header("x-served-from", "idempotency-record")


class Payment(BaseModel):
    amount: int


app = FastAPI()
app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)


@app.post("/payments", status_code=201)
@idempotent(on_execute=executed, on_replay=replayed)  # this route's hooks
async def pay(payment: Payment) -> dict[str, int]:
    return {"charged": payment.amount}


# --8<-- [end:hooks]


async def main() -> None:
    await store.migrate()
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    transport = httpx.ASGITransport(app=app)
    body = {"amount": 5}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://x"
    ) as http:
        first = await http.post("/payments", json=body, headers=headers)
        again = await http.post("/payments", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert "x-served-from" not in first.headers
    assert again.headers["x-served-from"] == "idempotency-record"
    assert runs == {"/payments": 1}  # two requests, one real execution
    print(dict(runs), again.headers["x-served-from"])
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
