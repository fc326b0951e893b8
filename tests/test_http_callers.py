"""Callers never share keys by accident: authenticated principals, ``caller=`` values and no
caller are three namespaces (a caller shaped like a hashed label or named ``anonymous`` shares
nobody's keys), a failing ``caller=`` is a 400, and metric labels stay bounded whatever the
callers."""

from __future__ import annotations

import hashlib
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import Metrics, PostgresStore
from consumer_idem.http import (
    ConfigurationError,
    IdempotencyMiddleware,
    idempotent,
)
from consumer_idem.http.callers import _caller_label
from tests._http import client_for, is_problem


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


async def test_a_caller_shaped_like_a_hashed_label_never_shares_keys(
    store: PostgresStore, scope: str
) -> None:
    async def me(request: Request) -> JSONResponse:
        return JSONResponse({"account": request.headers["x-account"]}, status_code=201)

    app = Starlette(routes=[Route("/statements", me, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-account"])
    victim = "accounts-payable-department-of-some-very-large-corporation-emea-1"  # > 64
    attacker = "sha256." + hashlib.sha256(victim.encode()).hexdigest()[:40]
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        await c.post("/statements", json={}, headers={**h, "x-account": victim})
        stolen = await c.post("/statements", json={}, headers={**h, "x-account": attacker})
    assert "idempotent-replayed" not in stolen.headers
    assert stolen.json() == {"account": attacker}
    assert _caller_label(attacker) != _caller_label(victim)


def test_verbatim_and_hashed_caller_labels_are_distinct_namespaces() -> None:
    long = "x" * 65
    hashed = _caller_label(long)
    assert hashed.startswith("sha256.")
    for verbatim in (hashed, "sha256.", "sha256.abc", "SHA256.x"):
        label = _caller_label(verbatim)
        assert not label.startswith("sha256."), label
    assert _caller_label("acme") == "acme"  # ordinary callers keep their readable label


async def test_a_caller_named_anonymous_never_shares_the_anonymous_keys(
    store: PostgresStore, scope: str
) -> None:
    async def create(request: Request) -> JSONResponse:
        return JSONResponse({"merchant": request.headers.get("x-merchant-id")}, status_code=201)

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        caller=lambda c: c.headers.get("x-merchant-id"),
        shared_keys=True,  # requests naming no merchant may share the anonymous keys
    )
    h = {"Idempotency-Key": scope}
    async with client_for(app) as c:
        named = await c.post("/orders", json={}, headers={**h, "x-merchant-id": "anonymous"})
        nobody = await c.post("/orders", json={}, headers=h)
    assert named.json() == {"merchant": "anonymous"}
    assert "idempotent-replayed" not in nobody.headers and nobody.json() == {"merchant": None}


def test_caller_labels_of_different_sources_never_meet(store: PostgresStore) -> None:
    class User:
        is_authenticated = True

        def __init__(self, identity: str) -> None:
            self.identity = identity

    def label(value: str | None, user: str | None = None) -> str:
        middleware = IdempotencyMiddleware(
            Starlette(), store=store, caller=lambda c: value, shared_keys=True
        )
        return middleware.caller_of({"type": "http", "user": user and User(user)})

    principals = {label(None, u) for u in ("bob", "u.bob", "x" * 80, "anonymous")}
    callers = {label(v) for v in ("u.bob", "bob", "user:bob", "anonymous", "c.bob", "x" * 80)}
    callers |= {label(v) for v in ("u.u.bob", "%75.bob", "sha256.x", "U.bob")}
    assert label(None) == "anonymous" and label(None, "bob") == "u.bob"
    assert label("acme") == "acme"  # ordinary callers keep their readable label
    assert "anonymous" not in principals | callers
    assert not principals & callers
    assert len(callers) == 10 and len(principals) == 4


async def test_a_caller_function_that_raises_is_a_400_not_a_500(
    store: PostgresStore, scope: str
) -> None:
    runs: list[str] = []

    async def create(request: Request) -> JSONResponse:
        runs.append("x")
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/orders", idempotent(required=True)(create), methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, caller=lambda c: c.headers["x-merchant-id"]
    )
    async with client_for(app) as c:
        r = await c.post("/orders", json={}, headers={"Idempotency-Key": scope})
    assert is_problem(r, 400, "caller-unknown"), r.text
    assert "x-merchant-id" not in r.text and runs == []
