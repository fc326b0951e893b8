"""Callers never share keys by accident, and metric labels stay bounded whatever the callers."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import Metrics, PostgresStore
from consumer_idem.http import ConfigurationError, IdempotencyMiddleware


class BearerUser(AuthenticationBackend):
    """``Authorization: User <name>`` authenticates <name> (enough for a test)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        value = conn.headers.get("authorization", "")
        if not value.startswith("User "):
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(value.removeprefix("User "))


def whoami_app(runs: list[str]) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        user = request.scope.get("user")  # set only where AuthenticationMiddleware runs
        name = user.display_name if user is not None and user.is_authenticated else "anonymous"
        runs.append(name)
        return JSONResponse({"created_for": name}, status_code=201)

    return Starlette(routes=[Route("/things", create, methods=["POST"])])


def client_for(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def test_no_way_to_tell_callers_apart_refuses_to_start(store: PostgresStore) -> None:
    """The refusal is kept for the server's start-up (see tests/test_http_startup_refusal.py)."""
    middleware = IdempotencyMiddleware(whoami_app([]), store=store)
    assert isinstance(middleware.refusal, ConfigurationError)
    assert "caller=" in str(middleware.refusal)


async def test_authenticated_principals_never_share_keys(store: PostgresStore, scope: str) -> None:
    runs: list[str] = []
    app = whoami_app(runs)
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
    app.add_middleware(AuthenticationMiddleware, backend=BearerUser())  # outside: runs first
    async with client_for(app) as c:
        alice = await c.post(
            "/things", json={}, headers={"Idempotency-Key": scope, "Authorization": "User alice"}
        )
        bob = await c.post(
            "/things", json={}, headers={"Idempotency-Key": scope, "Authorization": "User bob"}
        )
        again = await c.post(
            "/things", json={}, headers={"Idempotency-Key": scope, "Authorization": "User bob"}
        )
    assert alice.json() == {"created_for": "alice"}
    assert bob.json() == {"created_for": "bob"} and "idempotent-replayed" not in bob.headers
    assert again.json() == {"created_for": "bob"} and again.headers["idempotent-replayed"]
    assert runs == ["alice", "bob"]


async def test_a_caller_function_gets_the_connection(store: PostgresStore, scope: str) -> None:
    runs: list[str] = []
    app = whoami_app(runs)
    seen: list[str] = []

    def tenant(conn: HTTPConnection) -> str:
        seen.append(type(conn).__name__)
        return conn.headers["x-tenant"]

    app.add_middleware(IdempotencyMiddleware, store=store, caller=tenant)
    async with client_for(app) as c:
        for tenant_name in ("acme", "globex", "acme"):
            await c.post(
                "/things", json={}, headers={"Idempotency-Key": scope, "X-Tenant": tenant_name}
            )
    assert len(runs) == 2 and set(seen) == {"HTTPConnection"}
    assert await store.get("http:acme:POST /things", scope) is not None


async def test_metric_labels_are_bounded_and_the_registry_is_yours(
    pg_pool: Any, scope: str
) -> None:
    registry = CollectorRegistry()
    store = PostgresStore(pg_pool, metrics=Metrics(registry=registry))
    app = whoami_app([])
    app.add_middleware(IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-tenant"])
    async with client_for(app) as c:
        for i in range(5):  # five callers, one route
            for _ in range(2):
                await c.post(
                    "/things", json={}, headers={"Idempotency-Key": scope, "X-Tenant": f"t{i}"}
                )
    labels = [
        sample.labels
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name.startswith("consumer_idem_")
    ]
    assert labels, "nothing was registered on the registry passed in"
    values = {v for label in labels for v in label.values()}
    assert not any(f"t{i}" in v for v in values for i in range(5)), values
    assert "POST /things" in " ".join(values)
    http = {
        (s.labels["route"], s.labels["method"], s.labels["outcome"]): s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == "consumer_idem_http_requests_total"
    }
    assert http[("/things", "POST", "executed")] == 5
    assert http[("/things", "POST", "replayed")] == 5
