"""A resolver: the reconciler asks it what really happened to each `unknown` outcome.

consumer-idem reconcile --transport kafka --resolver myapp.reconcile:ask_gateway
"""

import asyncio
import os
import uuid

import asyncpg

from consumer_idem import (
    Ambiguous,
    Attempt,
    Executed,
    NotExecuted,
    PostgresStore,
    Record,
    Status,
    downstream_key_for,
    fingerprint_bytes,
    run_two_phase,
)
from consumer_idem.operations.reconcile import Answer, StillUnknown

DSN = os.environ.get("CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres")
GATEWAY: dict[str, dict[str, str]] = {}  # a stand-in for your gateway's "find charge" API


# --8<-- [start:resolver]
async def ask_gateway(record: Record) -> Answer:
    # the key every attempt passed to the gateway (Attempt.downstream_key)
    charge = GATEWAY.get(downstream_key_for(record.scope, record.key))
    if charge is None:
        return NotExecuted("no charge at the gateway")  # -> failed_retryable, re-dispatched
    if charge["status"] == "pending":
        return StillUnknown("gateway still processing")  # ask again later, with backoff
    return Executed({"charge_id": charge["id"]})  # -> completed, replayed to duplicates


# --8<-- [end:resolver]


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()

    async def charge(attempt: Attempt) -> None:
        GATEWAY[attempt.downstream_key] = {"id": "ch_1", "status": "succeeded"}
        raise Ambiguous("the gateway charged, then the connection dropped")

    key = f"pay-{uuid.uuid4().hex[:8]}"
    outcome = await run_two_phase(store, "docs.charges", key, fingerprint_bytes(b"p"), charge)
    print(outcome.kind)  # unknown: it may or may not have charged

    # what the reconciler does with the notice of this key: ask, then settle the record
    record = await store.get("docs.charges", key)
    assert record is not None
    answer = await ask_gateway(record)
    assert isinstance(answer, Executed | NotExecuted)
    await store.resolve("docs.charges", key, answer)
    settled = await store.get("docs.charges", key)
    assert settled is not None and settled.status is Status.COMPLETED
    print(settled.status, settled.result)
    await pool.close()


asyncio.run(main())
