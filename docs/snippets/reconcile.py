"""A resolver: the reconciler asks it what really happened to each `unknown`
outcome.

consumer-idem reconcile --transport kafka --resolver myapp.reconcile:ask_gateway
"""

# --8<-- [start:resolver]
from consumer_idem import Executed, NotExecuted, Record, downstream_key_for
from consumer_idem.operations.reconcile import Answer, StillUnknown

# a stand-in for your gateway's "find charge" API
GATEWAY: dict[str, dict[str, str]] = {}


async def ask_gateway(record: Record) -> Answer:
    # the key every attempt passed to the gateway (Attempt.downstream_key)
    charge = GATEWAY.get(downstream_key_for(record.scope, record.key))
    if charge is None:
        # -> failed_retryable, re-dispatched
        return NotExecuted("no charge at the gateway")
    if charge["status"] == "pending":
        # ask again later, with backoff
        return StillUnknown("gateway still processing")
    # -> completed, replayed to duplicates
    return Executed({"charge_id": charge["id"]})


# --8<-- [end:resolver]


async def main() -> None:
    import os
    import uuid

    from consumer_idem import (
        Ambiguous,
        Attempt,
        PostgresStore,
        Status,
        fingerprint_bytes,
        run_two_phase,
    )

    dsn = os.environ.get(
        "CONSUMER_IDEM_PG_DSN",
        "postgresql://postgres:postgres@127.0.0.1/postgres",
    )
    store = PostgresStore.from_dsn(dsn)
    await store.migrate()

    async def charge(attempt: Attempt) -> None:
        GATEWAY[attempt.downstream_key] = {"id": "ch_1", "status": "succeeded"}
        raise Ambiguous("the gateway charged, then the connection dropped")

    key = f"pay-{uuid.uuid4().hex[:8]}"
    outcome = await run_two_phase(
        store, "docs.charges", key, fingerprint_bytes(b"p"), charge
    )
    print(outcome.kind)  # unknown: it may or may not have charged

    # what the reconciler does with the notice of this key: ask, then settle the
    # record
    record = await store.get("docs.charges", key)
    assert record is not None
    answer = await ask_gateway(record)
    assert isinstance(answer, Executed | NotExecuted)
    await store.resolve("docs.charges", key, answer)
    settled = await store.get("docs.charges", key)
    assert settled is not None and settled.status is Status.COMPLETED
    print(settled.status, settled.result)
    await store.close()


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
