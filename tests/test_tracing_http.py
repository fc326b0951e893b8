"""OpenTelemetry tracing of requests through ``IdempotencyMiddleware``, with the SDK's in-memory
exporter: one trace per request with the claim's child spans; a SERVER span of the library's own
(continuing the caller's ``traceparent``) when nothing else traces the request, an INTERNAL
child of the ASGI instrumentation's span, without its HTTP attributes, when it does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.trace import SpanKind

from consumer_idem import PostgresStore, tracing
from consumer_idem.http import IdempotencyMiddleware
from tests.test_tracing import Traces, attrs, one, step_names


@pytest.fixture
def traces() -> Iterator[Traces]:
    traces = Traces()
    tracing.configure(tracer_provider=traces.provider)
    yield traces
    tracing.configure()
    traces.provider.shutdown()


def orders_app(store: PostgresStore, runs: list[Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/orders/{order_id}")
    async def create(order_id: str, request: Request) -> dict[str, Any]:
        conn = request.state.idempotency.connection
        runs.append(await conn.fetchval("SELECT $1::text", order_id))
        return {"order": order_id}

    app.add_middleware(IdempotencyMiddleware, store=store, caller=lambda conn: "tenant-a")
    return app


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    clients: list[httpx.AsyncClient] = []

    def make(app: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://test"))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()


async def test_one_trace_per_request_continuing_the_callers_traceparent(
    traces: Traces, store: PostgresStore, client_for: Any, scope: str
) -> None:
    runs: list[Any] = []
    client = client_for(orders_app(store, runs))
    key = f"{scope}-order"
    requests = [
        ("/orders/1", {"n": 1}, "execute", "executed", 200),
        ("/orders/1", {"n": 1}, "replay", "replayed", 200),  # the client's retry
        ("/orders/1", {"n": 2}, "misuse", "key_misuse", 422),  # the key, another request
    ]
    callers = []
    for path, body, decision, outcome, status in requests:
        carrier, caller = traces.produce("client POST")
        response = await client.post(path, json=body, headers={"Idempotency-Key": key, **carrier})
        assert response.status_code == status
        callers.append((caller, decision, outcome, status))
    assert runs == ["1"]

    for caller, decision, outcome, status in callers:
        spans = traces.trace_of(caller)
        ours = one([s for s in spans if s.kind is SpanKind.SERVER])
        # nothing traced the request before us: our span is its server span, in the caller's
        # trace (a child of the client's span), with the HTTP attributes
        assert ours.parent is not None and ours.parent.span_id == caller.span_id
        assert ours.name == "POST /orders/{order_id}"
        a = attrs(ours)
        assert a["http.request.method"] == "POST"
        assert a["http.route"] == "/orders/{order_id}"
        assert a["http.response.status_code"] == status
        assert a["consumer_idem.decision"] == decision
        assert a["consumer_idem.outcome"] == outcome
        # the record scope without its caller (the tenant is no attribute), the key hashed
        assert a["consumer_idem.scope"] == "http:POST /orders/{order_id}"
        assert a["consumer_idem.key"] == tracing.key_attribute(key)
        assert all(key not in str(v) and "tenant-a" not in str(v) for v in a.values())
        expected = ["consumer_idem.reserve"]
        if decision == "execute":
            expected = ["consumer_idem.commit", "consumer_idem.handler", "consumer_idem.reserve"]
        assert step_names(traces, ours) == expected
    # one trace per request: three traces, no span outside them
    assert len({s.context.trace_id for s in traces.spans()}) == 3


async def test_under_the_asgi_instrumentation_the_span_is_its_internal_child(
    traces: Traces, store: PostgresStore, client_for: Any, scope: str
) -> None:
    runs: list[Any] = []
    app = OpenTelemetryMiddleware(orders_app(store, runs), tracer_provider=traces.provider)
    client = client_for(app)
    response = await client.post("/orders/7", json={}, headers={"Idempotency-Key": scope})
    assert response.status_code == 200 and runs == ["7"]
    again = await client.post("/orders/7", json={}, headers={"Idempotency-Key": scope})
    assert again.headers["idempotent-replayed"] == "true"

    servers = [s for s in traces.spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == 2 and len({s.context.trace_id for s in servers}) == 2
    for server, decision in zip(servers, ("execute", "replay"), strict=True):
        ours = one([s for s in traces.children(server) if s.name.startswith("idempotency ")])
        assert ours.kind is SpanKind.INTERNAL
        assert ours.name == "idempotency POST /orders/{order_id}"
        a = attrs(ours)
        assert a["consumer_idem.decision"] == decision
        # the instrumentation's span has the HTTP attributes; ours does not repeat them
        assert not any(name.startswith("http.") for name in a)
        server_attrs = attrs(server)  # the instrumentation's semconv version decides the name
        status = server_attrs.get("http.response.status_code", server_attrs.get("http.status_code"))
        assert status == 200
        expected = ["consumer_idem.reserve"]
        if decision == "execute":
            expected = ["consumer_idem.commit", "consumer_idem.handler", "consumer_idem.reserve"]
        assert step_names(traces, ours) == expected
