"""A small stand-in payment gateway, a real ASGI app for loopback tests and examples.

    uvicorn examples.fake_gateway:app --host 127.0.0.1 --port 8081

POST /charges  (JSON {"amount_cents", "currency", "customer_id"}, header Idempotency-Key)
    201 {"charge_id", "status": "succeeded", ...}; the same key again returns the same charge
    (200). An amount ending in 13 cents is declined: 402 {"status": "declined"}.
GET  /charges/{idempotency_key}   the charge made for that key, or 404 (for reconciliation)

With GATEWAY_WEBHOOK_URL and GATEWAY_WEBHOOK_SECRET set, every charge is also announced as a
Standard Webhooks event (``charge.succeeded`` / ``charge.declined``) to that URL, retried with
backoff until it is acknowledged with a 2xx (at most 8 attempts).
GET  /_stats                      {"charges", "requests"}
POST /_faults                     inject failures into the next charges:
    {"timeout_after_charge": n}   charge, then hang (the client times out: outcome unknown)
    {"fail_before_charge": n}     503 without charging (provably not executed)
    {"slow_charge_ms": ms}        the next charge answers only after ms milliseconds (a request
                                  still running when its duplicate arrives)
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class Gateway:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.charges: dict[str, dict[str, Any]] = {}
        self.requests = 0
        self.faults = {"timeout_after_charge": 0, "fail_before_charge": 0, "slow_charge_ms": 0}
        self.lock = asyncio.Lock()


state = Gateway()


async def create_charge(request: Request) -> JSONResponse:
    state.requests += 1
    key = request.headers.get("idempotency-key")
    if not key:
        return JSONResponse({"error": "Idempotency-Key header required"}, status_code=400)
    try:
        body = await request.json()
        amount, currency = int(body["amount_cents"]), str(body["currency"])
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": "amount_cents and currency required"}, status_code=422)
    async with state.lock:
        if state.faults["fail_before_charge"] > 0:
            state.faults["fail_before_charge"] -= 1
            return JSONResponse({"error": "temporarily unavailable"}, status_code=503)
        existing = state.charges.get(key)
        if existing is not None:
            return JSONResponse(
                existing, status_code=200 if existing["status"] != "declined" else 402
            )
        declined = amount % 100 == 13
        charge = {
            "charge_id": f"ch_{uuid.uuid4().hex[:16]}",
            "status": "declined" if declined else "succeeded",
            "amount_cents": amount,
            "currency": currency,
            "customer_id": body.get("customer_id"),
            "metadata": body.get("metadata") or {},
            "idempotency_key": key,
        }
        state.charges[key] = charge
        hang = state.faults["timeout_after_charge"] > 0
        if hang:
            state.faults["timeout_after_charge"] -= 1
        slow, state.faults["slow_charge_ms"] = state.faults["slow_charge_ms"], 0
        if os.environ.get("GATEWAY_WEBHOOK_URL"):
            state.tasks.add(asyncio.create_task(announce(charge)))
    if hang:
        await asyncio.sleep(30)  # the charge exists; the caller never hears about it
    await asyncio.sleep(slow / 1000)
    return JSONResponse(charge, status_code=402 if declined else 201)


async def announce(charge: dict[str, Any]) -> None:
    """Send the charge's webhook event, Standard Webhooks signed, retrying until a 2xx."""
    import httpx

    from consumer_idem.webhooks import sign_standard

    event_type = "charge.declined" if charge["status"] == "declined" else "charge.succeeded"
    event = {"id": f"evt_{uuid.uuid4().hex[:16]}", "type": event_type, "data": charge}
    body = json.dumps(event).encode()
    delay = 0.3
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(8):
            headers = sign_standard(
                body, os.environ["GATEWAY_WEBHOOK_SECRET"], event["id"], int(time.time())
            )
            try:
                response = await client.post(
                    os.environ["GATEWAY_WEBHOOK_URL"],
                    content=body,
                    headers={**headers, "content-type": "application/json"},
                )
                if response.is_success:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def get_charge(request: Request) -> JSONResponse:
    charge = state.charges.get(request.path_params["key"])
    if charge is None:
        return JSONResponse({"error": "no charge for that key"}, status_code=404)
    return JSONResponse(charge)


async def stats(request: Request) -> JSONResponse:
    return JSONResponse({"charges": len(state.charges), "requests": state.requests})


async def faults(request: Request) -> JSONResponse:
    body = await request.json()
    for name in state.faults:
        if name in body:
            state.faults[name] = int(body[name])
    return JSONResponse(state.faults)


app = Starlette(
    routes=[
        Route("/charges", create_charge, methods=["POST"]),
        Route("/charges/{key:path}", get_charge, methods=["GET"]),
        Route("/_stats", stats, methods=["GET"]),
        Route("/_faults", faults, methods=["POST"]),
    ]
)
