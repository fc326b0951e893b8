"""run_two_phase: the effect is an external call (a payment gateway), made
under a lease."""

import asyncio
import os
import uuid

import asyncpg

from consumer_idem import (
    Ambiguous,
    Attempt,
    DomainError,
    PostgresStore,
    Retryable,
    fingerprint_json,
    run_two_phase,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


class Gateway:
    """A stand-in for your payment gateway's client: it dedupes on the
    idempotency key."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}

    async def charge(self, cents: int, idempotency_key: str) -> str:
        if cents % 100 == 13:
            raise ValueError("declined")
        return self.charges.setdefault(
            idempotency_key, f"ch_{uuid.uuid4().hex[:8]}"
        )


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS charges (charge_id text PRIMARY KEY)"
    )
    gateway = Gateway()
    payment = {
        "payment_id": f"pay-{uuid.uuid4().hex[:8]}",
        "amount_cents": 1999,
    }

    # outside any transaction
    async def charge(attempt: Attempt) -> dict[str, str]:
        try:
            charge_id = await gateway.charge(
                payment["amount_cents"], idempotency_key=attempt.downstream_key
            )
        except ConnectionRefusedError as exc:
            raise Retryable("gateway unreachable") from exc  # provably not sent
        except TimeoutError as exc:
            # parked unknown
            raise Ambiguous("gateway timed out after sending") from exc
        except ValueError as exc:
            # stored and replayed
            raise DomainError({"status": "declined"}) from exc
        return {"charge_id": charge_id}

    async def record(conn: asyncpg.Connection, result: dict[str, str]) -> None:
        # local rows, committed with the completion
        await conn.execute(
            "INSERT INTO charges VALUES ($1)", result["charge_id"]
        )

    key, fp = payment["payment_id"], fingerprint_json(payment)
    first = await run_two_phase(
        store, "charges", key, fp, charge, local_writes=record, lease=30
    )
    again = await run_two_phase(
        store, "charges", key, fp, charge, local_writes=record, lease=30
    )
    # executed, replayed: charged once
    print(first.kind, again.kind, again.result)
    assert first.result == again.result and len(gateway.charges) == 1
    await pool.close()


asyncio.run(main())
