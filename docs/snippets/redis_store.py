"""RedisStore: the same state machine in Redis, for effects that do not live
in Postgres."""

import asyncio
import os
import uuid

import redis.asyncio as aioredis

from consumer_idem import Attempt, RedisStore, fingerprint_bytes, run_two_phase

REDIS_URL = os.environ.get(
    "CONSUMER_IDEM_REDIS_URL", "redis://127.0.0.1:6379/0"
)


async def main() -> None:
    redis = aioredis.from_url(REDIS_URL)
    # two-phase only: no shared transaction
    store = RedisStore(redis, prefix="docs-idem:")
    sent: list[str] = []

    async def send_email(attempt: Attempt) -> dict[str, str]:
        # your mail provider, keyed by downstream_key
        sent.append(attempt.downstream_key)
        return {"message_id": f"m-{len(sent)}"}

    key, fp = f"welcome-{uuid.uuid4().hex[:8]}", fingerprint_bytes(b"user-7")
    for _ in range(3):
        outcome = await run_two_phase(
            store, "emails.welcome", key, fp, send_email
        )
        print(outcome.kind, outcome.result)
    assert len(sent) == 1
    await redis.aclose()


asyncio.run(main())
