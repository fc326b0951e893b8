"""A payments API with ``Idempotency-Key``, charging a (stand-in) payment gateway.

    uvicorn examples.fake_gateway:app --port 8081        # the gateway (GATEWAY_URL)
    uvicorn examples.payments_api:app --port 8000        # this API

POST /payments            {"customer_id", "amount_cents", "currency"}, Idempotency-Key required
                          -> 201 {"payment_id", "status": "succeeded"} (402 when declined)
POST /webhooks/gateway    the gateway's Standard Webhooks events (GATEWAY_WEBHOOK_SECRET); a
                          charge event settles a payment whose outcome was unknown

The charge is external I/O, so the route is two-phase: the key is claimed with a lease, the
gateway is called with a key derived from ours (it dedupes our retries too), and the payment
row is written in the transaction that stores the response. If the gateway takes the money but
never answers, the payment is ``unknown`` (retries get 409) until the gateway's webhook says
what happened; then a retry replays the 201 byte for byte. A duplicate that arrives while the
first request is still charging waits for it (up to ``WAIT_SECONDS``) and gets its response.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from fastapi import FastAPI, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from consumer_idem import (
    DomainError,
    Executed,
    NotExecuted,
    PostgresStore,
    Retryable,
    Status,
    create_pool,
)
from consumer_idem.cli.settings import load_settings
from consumer_idem.http import IdempotencyMiddleware, idempotent
from consumer_idem.types import StoredResponse
from consumer_idem.webhooks import WebhookReceiver, resolve_unknown, standard_verifier
from handlers.gateway import GatewayClient

PAYMENTS_SQL = """
CREATE TABLE IF NOT EXISTS api_payments (
    payment_id   text PRIMARY KEY,
    customer_id  text NOT NULL,
    amount_cents bigint NOT NULL,
    currency     text NOT NULL,
    charge_id    text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)
"""
#: how long a duplicate waits for the first request in flight before a 409: longer than the
#: gateway's timeout, so it gets the first one's answer
WAIT_SECONDS = 5.0
DEV_SECRET = "whsec_ZGV2LW9ubHktd2ViaG9vay1zZWNyZXQtY2hhbmdlLW1l"  # only when the env has none


class PaymentIn(BaseModel):
    customer_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0, le=10_000_000)
    currency: str = Field(pattern=r"^[A-Z]{3}$")


class PaymentOut(BaseModel):
    payment_id: str
    status: str


def payment_id_for(scope: str, key: str) -> str:
    """Deterministic: the endpoint and the webhook name the same payment the same way."""
    return "pay_" + hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()[:24]


def render(payment_id: str, status: str) -> bytes:
    """The response body, built one way by both the endpoint and the webhook."""
    return json.dumps({"payment_id": payment_id, "status": status}, separators=(",", ":")).encode()


JSON_HEADERS = {"content-type": "application/json"}


def create_app(store: PostgresStore | None = None, gateway_url: str | None = None) -> FastAPI:
    holder: dict[str, Any] = {"store": store}
    secret = os.environ.get("GATEWAY_WEBHOOK_SECRET", DEV_SECRET)
    if secret == DEV_SECRET:
        logging.getLogger("payments_api").warning(
            "GATEWAY_WEBHOOK_SECRET is not set: using the development secret; anyone who reads "
            "this file can forge gateway webhooks. Set your own outside a laptop."
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = None
        if holder["store"] is None:
            settings = load_settings()
            # behind a transaction pooler (CONSUMER_IDEM_PG_POOLER=transaction): no LISTEN,
            # no statement cache
            pool = await create_pool(
                settings.pg_dsn, pooler=settings.pg_pooler, min_size=2, max_size=20
            )
            holder["store"] = PostgresStore(
                pool, schema=settings.schema_name, pooler=settings.pg_pooler
            )
        await holder["store"].migrate()
        async with holder["store"].pool.acquire() as conn:
            await conn.execute(PAYMENTS_SQL)
        holder["gateway"] = GatewayClient(gateway_url, timeout=2.0)
        yield
        await holder["gateway"].aclose()
        if pool is not None:
            await pool.close()

    app = FastAPI(title="consumer-idem payments example", lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        store=lambda: holder["store"],
        # keys never cross callers: a real API would name the authenticated merchant here
        caller=lambda conn: conn.headers.get("x-tenant", "public"),
    )

    @app.post(
        "/payments",
        status_code=201,
        response_model=PaymentOut,
        responses={
            400: {"description": "Idempotency-Key missing or malformed"},
            402: {"description": "card declined (stored and replayed)"},
            409: {"description": "a request with this key is in flight, or its outcome unknown"},
            422: {"description": "invalid body, or the key was used with another body"},
            503: {"description": "idempotency store or gateway unavailable; retry later"},
        },
    )
    @idempotent(required=True, mode="two_phase", wait=WAIT_SECONDS)
    async def create_payment(
        payment: PaymentIn,
        request: Request,
        idempotency_key: str = Header(alias="Idempotency-Key", max_length=300),
    ) -> Response:
        idem = request.state.idempotency
        payment_id = payment_id_for(idem.scope, idem.key)
        try:
            charge = await holder["gateway"].charge(
                amount_cents=payment.amount_cents,
                currency=payment.currency,
                customer_id=payment.customer_id,
                idempotency_key=idem.downstream_key,
                metadata={"scope": idem.scope, "key": idem.key},
            )
        except DomainError:
            return Response(render(payment_id, "declined"), 402, media_type="application/json")

        async def record(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "INSERT INTO api_payments (payment_id, customer_id, amount_cents, currency,"
                " charge_id) VALUES ($1, $2, $3, $4, $5)",
                payment_id,
                payment.customer_id,
                payment.amount_cents,
                payment.currency,
                charge["charge_id"],
            )

        idem.add_write(record)
        return Response(render(payment_id, "succeeded"), 201, media_type="application/json")

    async def on_gateway_event(event: dict[str, Any], conn: asyncpg.Connection) -> Any:
        store: PostgresStore = holder["store"]
        charge = event.get("data") or {}
        metadata = charge.get("metadata") or {}
        scope, key = metadata.get("scope"), metadata.get("key")
        if not scope or not key:
            return {"ignored": "not one of ours"}
        record = await store.get(scope, key)
        if record is None:
            return {"ignored": "unknown payment"}
        if record.status is Status.IN_PROGRESS:
            # our request is still waiting for the gateway: the gateway must deliver it again
            raise Retryable("the payment request has not finished yet")
        payment_id = payment_id_for(scope, key)
        kind = event.get("type")
        if kind == "charge.succeeded":
            resolution: Executed | NotExecuted = Executed(
                {"payment_id": payment_id, "status": "succeeded"},
                response=StoredResponse(201, JSON_HEADERS, render(payment_id, "succeeded")),
            )
        elif kind == "charge.declined":
            resolution = Executed(
                {"payment_id": payment_id, "status": "declined"},
                response=StoredResponse(402, JSON_HEADERS, render(payment_id, "declined")),
            )
        elif kind == "charge.not_created":
            resolution = NotExecuted("the gateway created no charge")
        else:
            return {"ignored": kind}
        if await resolve_unknown(store, scope, key, resolution, conn=conn) and (
            kind == "charge.succeeded"
        ):
            await conn.execute(  # the local write the interrupted request could not make
                "INSERT INTO api_payments (payment_id, customer_id, amount_cents, currency,"
                " charge_id) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                payment_id,
                charge.get("customer_id") or "",
                charge["amount_cents"],
                charge["currency"],
                charge["charge_id"],
            )
        return {"settled": key}

    # the store exists once the app has started: the receiver asks the factory per request
    receiver = WebhookReceiver(
        lambda: holder["store"], "gateway", standard_verifier([secret]), on_gateway_event
    )
    app.add_api_route("/webhooks/gateway", receiver, methods=["POST"], include_in_schema=False)
    return app


app = create_app()
