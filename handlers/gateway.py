"""Reference two-phase handler: charge a payment gateway over HTTP, exactly once.

The charge is external I/O, so it runs in two-phase mode: the key is claimed with a lease, the
HTTP call runs outside any transaction with a downstream idempotency key derived from ours (so
the gateway dedupes our own retries too), and the outcome is classified:

* the connection could not be made, or the gateway answered 429/503: nothing was charged ->
  ``Retryable``;
* the request may have reached the gateway but no answer came (timeout, connection dropped, any
  other 5xx) -> ``Ambiguous``: parked as ``unknown`` for reconciliation, never re-sent blindly;
* 402 declined -> ``DomainError``: a deterministic answer, stored and replayed;
* 2xx -> the charge, stored as the result; ``record_charge`` writes it locally in the
  completion's transaction.
"""

from __future__ import annotations

import os
from typing import Any

import asyncpg
import httpx

from consumer_idem import Ambiguous, Attempt, ConsumerMessage, DomainError, Retryable
from handlers.payments import parse_payment

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8081"

CHARGES_SQL = """
CREATE TABLE IF NOT EXISTS demo_charges (
    payment_id   text PRIMARY KEY,
    charge_id    text NOT NULL,
    amount_cents bigint NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
)
"""


class GatewayClient:
    def __init__(self, base_url: str | None = None, timeout: float = 5.0) -> None:
        self.base_url = base_url or os.environ.get("GATEWAY_URL", DEFAULT_GATEWAY_URL)
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def charge(
        self,
        *,
        amount_cents: int,
        currency: str,
        customer_id: str,
        idempotency_key: str,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        try:
            response = await self.http.post(
                "/charges",
                json={
                    "amount_cents": amount_cents,
                    "currency": currency,
                    "customer_id": customer_id,
                    "metadata": metadata or {},
                },
                headers={"Idempotency-Key": idempotency_key},
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise Retryable(f"gateway unreachable: {exc!r}", code="gateway_unreachable") from exc
        except httpx.HTTPError as exc:  # sent, but no answer: it may have charged
            raise Ambiguous(f"no answer from the gateway: {exc!r}", code="gateway_timeout") from exc
        if response.status_code in (429, 503):
            raise Retryable(f"gateway refused: {response.status_code}", code="gateway_busy")
        if response.status_code == 402:
            raise DomainError(response.json(), "card declined")
        if response.status_code >= 500:
            raise Ambiguous(f"gateway error {response.status_code}", code="gateway_5xx")
        if response.status_code >= 400:
            # our request is wrong: deterministic, store it as the answer
            raise DomainError({"status": "rejected", "http_status": response.status_code})
        charge: dict[str, Any] = response.json()
        return charge


def charge_handler(client: GatewayClient) -> Any:
    """``@idempotent_consumer(..., mode="two_phase")`` handler charging through ``client``."""

    async def charge_payment(message: ConsumerMessage, attempt: Attempt) -> dict[str, Any]:
        p = parse_payment(message)
        charge = await client.charge(
            amount_cents=p.amount_cents,
            currency=p.currency,
            customer_id=p.customer_id,
            idempotency_key=attempt.downstream_key,
        )
        return {"payment_id": p.payment_id, **charge}

    return charge_payment


async def record_charge(conn: asyncpg.Connection, charge: dict[str, Any]) -> None:
    """Local writes committed with the completion (``local_writes=`` of the decorator)."""
    await conn.execute(
        "INSERT INTO demo_charges (payment_id, charge_id, amount_cents) VALUES ($1, $2, $3)",
        charge["payment_id"],
        charge["charge_id"],
        charge["amount_cents"],
    )
