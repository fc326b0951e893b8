"""The testing kit reaches your handler's own call: it takes effect, then
times out."""

# --8<-- [start:handler]
import asyncio
import json
import os
import uuid
from collections import Counter
from typing import Any

import asyncpg

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    PostgresStore,
    Retryable,
    idempotent_consumer,
)
from consumer_idem.testing import (
    ExternalCall,
    NotIdempotent,
    assert_idempotent,
    fresh_store,
)

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


class GatewayTimeout(Exception):
    """Your client's error when the gateway's answer did not come in time."""


def charge_handler(store: PostgresStore, charge: Any) -> Any:
    """A two-phase handler built on the call it makes: production passes the
    real client's method, a test passes it wrapped in ExternalCall."""

    @idempotent_consumer(store, scope="docs.charge", mode="two_phase")
    async def charge_payment(
        message: ConsumerMessage, attempt: Attempt
    ) -> dict[str, Any]:
        payment = message.json()
        try:
            result: dict[str, Any] = await charge(
                payment["id"], payment["amount"]
            )
        # the request left: the card may have been charged
        except GatewayTimeout as exc:
            raise Ambiguous(f"gateway timeout: {exc}") from exc
        return result

    return charge_payment


# --8<-- [end:handler]


# --8<-- [start:kit]
class FakeGateway:
    """Charges on every request, as a gateway that keeps no idempotency keys
    does."""

    def __init__(self) -> None:
        self.charges: Counter[str] = Counter()

    async def charge(self, payment_id: str, amount: int) -> dict[str, Any]:
        self.charges[payment_id] += 1
        return {"charge": f"ch_{payment_id}", "amount": amount}


def new_payment() -> ConsumerMessage:
    pid = f"pay-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"id": pid, "amount": 1250}).encode()
    return ConsumerMessage(body, {"idempotency-key": pid.encode()})


async def main() -> None:
    async with fresh_store(DSN) as store:
        gateway = FakeGateway()
        call = ExternalCall(
            gateway.charge, failure=lambda: GatewayTimeout("read timeout")
        )
        consumer = charge_handler(store, call)

        async def charged(
            conn: asyncpg.Connection, message: ConsumerMessage
        ) -> int:
            return gateway.charges[message.json()["id"]]

        report = await assert_idempotent(
            consumer, new_payment, charged, external=call
        )
        assert "the call took effect, then failed" in report.passed
        print(f"{len(report.passed)} scenarios passed")

    async with fresh_store(DSN) as store:
        # the same handler, turning the timeout into Retryable: it charges
        # twice, and says so
        gateway = FakeGateway()
        call = ExternalCall(
            gateway.charge, failure=lambda: GatewayTimeout("read timeout")
        )

        @idempotent_consumer(store, scope="docs.charge", mode="two_phase")
        async def retrying(message: ConsumerMessage, attempt: Attempt) -> Any:
            payment = message.json()
            try:
                return await call(payment["id"], payment["amount"])
            except GatewayTimeout as exc:
                raise Retryable("gateway timeout") from exc

        async def charged_twice(
            conn: asyncpg.Connection, message: ConsumerMessage
        ) -> int:
            return gateway.charges[message.json()["id"]]

        try:
            await assert_idempotent(
                retrying, new_payment, charged_twice, external=call
            )
        except NotIdempotent as caught:
            assert caught.scenario == "the call took effect, then failed"
            print(caught)
        else:
            raise AssertionError("a handler that charges twice passed")


# --8<-- [end:kit]


asyncio.run(main())
