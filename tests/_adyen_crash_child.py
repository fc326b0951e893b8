"""A process that receives an Adyen batch and is killed (SIGKILL) while its second item's
effect is written, before that item commits: argv = DSN, effects table, provider, HMAC key,
the batch's body."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem import webhooks as wh


async def main(dsn: str, table: str, provider: str, key: str, body: str) -> None:
    pool = await asyncpg.create_pool(dsn)
    store = PostgresStore(pool)
    seen: list[str] = []

    async def on_item(item: dict[str, Any], conn: asyncpg.Connection) -> None:
        await conn.execute(f"INSERT INTO {table} VALUES ($1)", item["pspReference"])
        seen.append(item["pspReference"])
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    receiver = wh.WebhookReceiver(store, provider, wh.adyen_verifier([key]), on_item)
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        await client.post("/hook", content=body.encode())


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
