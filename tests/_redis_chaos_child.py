"""A FastStream Redis stream consumer process for the SIGKILL test of
``tests/test_faststream_redis.py``: one reading subscriber and one claiming subscriber
(``XAUTOCLAIM``) of a consumer group, through the Idempotency middleware.

    python -m tests._redis_chaos_child <redis_url> <stream> <group> <consumer> <scope> \
        [max_deliveries] [batch]

With ``batch``, the reading subscriber is a batch one (``StreamSub(..., batch=True)``, its own
handler over the list of bodies); the claiming subscriber stays a single-entry one. A message
whose body says ``"fail_in_batch": true`` fails in the batch handler (and kills in the other).

Prints ``{"event": "started"}`` once the broker reads; runs until killed. The DSN comes from
``CONSUMER_IDEM_PG_DSN``; each message's effect goes to ``fs_effects`` in its transaction. A
message whose body says ``"kill": true`` SIGKILLs the process in its handler, before the commit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import asyncpg
from faststream import AckPolicy
from faststream.redis import RedisBroker, RedisRouter, StreamSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import (
    CurrentIdempotency,
    CurrentIdempotencyBatch,
    Idempotency,
    IdempotentConnection,
)
from tests._faststream import write_effect

#: how long an entry stays pending before the claiming subscriber takes it (ms)
CLAIM_AFTER_MS = 800


async def main(
    redis_url: str,
    stream: str,
    group: str,
    consumer: str,
    scope: str,
    limit: str = "",
    batch: str = "",
) -> None:
    pool = await asyncpg.create_pool(os.environ["CONSUMER_IDEM_PG_DSN"], min_size=1)
    assert pool is not None
    store = PostgresStore(pool)
    broker = RedisBroker(redis_url, logger=None)
    budget = {"max_deliveries": int(limit)} if limit else {}
    idem = Idempotency(store, broker=broker, scope=scope, backoff=(0.05, 0.2), **budget)
    router = RedisRouter(middlewares=[idem])

    claiming = router.subscriber(
        stream=StreamSub(stream, group=group, consumer=consumer, min_idle_time=CLAIM_AFTER_MS),
        ack_policy=AckPolicy.MANUAL,
    )
    reading = router.subscriber(
        stream=StreamSub(stream, group=group, consumer=consumer, max_records=10, batch=bool(batch)),
        ack_policy=AckPolicy.MANUAL,
    )

    async def handle(
        data: dict[str, Any], conn: IdempotentConnection, current: CurrentIdempotency
    ) -> None:
        if data.get("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        await write_effect(conn, current, data["n"])
        await asyncio.sleep(0.005)  # a kill often lands inside the transaction

    async def handle_batch(
        bodies: list[dict[str, Any]], conn: IdempotentConnection, current: CurrentIdempotencyBatch
    ) -> None:
        for key, data in zip(current.keys, bodies, strict=True):
            if data.get("fail_in_batch"):  # a failure the batch's settling counts
                raise ConnectionError("the far side refuses it")
            if data.get("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            await conn.execute(
                "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)", scope, key, data["n"]
            )

    if batch:
        reading(handle_batch)
        claiming(handle)
    else:
        reading(claiming(handle))

    broker.include_router(router)
    await broker.start()
    print(json.dumps({"event": "started"}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:8]))
