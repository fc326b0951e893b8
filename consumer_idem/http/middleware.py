"""The ASGI middleware: its set-up, and each request admitted, then handled."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import ASGIApp as StarletteASGIApp

from consumer_idem import http_refusal, tracing
from consumer_idem.errors import ConfigurationError
from consumer_idem.http._compat import running
from consumer_idem.http.admission import admit
from consumer_idem.http.asgi import ASGIApp, Receive, Scope, Send
from consumer_idem.http.callers import Caller, caller_of
from consumer_idem.http.capture import Captured, endpoint_scope
from consumer_idem.http.context import IdempotencyContext
from consumer_idem.http.fail_open import HeldKeys
from consumer_idem.http.hooks import RequestHook
from consumer_idem.http.keyed_request import KeyedRequest
from consumer_idem.http.routing import Mode, find_router
from consumer_idem.metrics import Metrics
from consumer_idem.stores.postgres.store import PostgresStore


def _checked_setup(
    app: Any, caller: Caller | None, shared_keys: bool, mode: str, wait: float, router: Any
) -> Any:
    """The router whose routes decide, or the
    [`ConfigurationError`][consumer_idem.ConfigurationError] of a set-up that
    could not keep the middleware's promise."""
    if caller is None and not shared_keys:
        raise ConfigurationError(
            "IdempotencyMiddleware cannot tell callers apart: pass caller=<fn(conn) -> str>"
            " (a tenant, user or API key id), or shared_keys=True to accept that requests"
            " without an authenticated scope['user'] share one key space"
        )
    if mode not in ("transactional", "two_phase"):
        raise ConfigurationError(f"mode is 'transactional' or 'two_phase', not {mode!r}")
    if wait < 0:
        raise ConfigurationError("wait is a number of seconds, 0 or more")
    routes_from = find_router(app if router is None else router)
    if routes_from is None:
        raise ConfigurationError(
            f"IdempotencyMiddleware cannot find the routes of {app!r}: it wraps no Starlette"
            " or FastAPI app it can see through (each middleware in between must keep the"
            " app it wraps as `.app`), so it could not tell which requests to protect. Add"
            " it with app.add_middleware(IdempotencyMiddleware, ...), or pass router=<the"
            " Starlette/FastAPI app>"
        )
    return routes_from


class IdempotencyMiddleware:
    """Wrap a Starlette/FastAPI app: ``app.add_middleware(IdempotencyMiddleware, store=store,
    caller=...)``.

    ``caller(conn)`` names the caller of a request (a tenant, a user) from the
    ``HTTPConnection``; keys never cross callers. Without it, an authenticated
    ``scope["user"]`` is the caller. Requests with neither share one key space, ``anonymous``:
    the middleware refuses to start unless it is given ``caller=`` or ``shared_keys=True``,
    because it cannot see principals an app authenticates elsewhere (a FastAPI dependency) and
    would replay one caller's response to another. ``wait`` (seconds): how long a duplicate
    waits for a request in flight instead of a 409 (per route: ``@idempotent(wait=...)``).
    ``metrics``: where request outcomes are counted (default: the store's).

    Routes decide which requests take part, so the middleware must see the router: the app
    it wraps, or the one behind the middleware around it (followed through their ``.app``).
    When it cannot, it refuses to start ([`ConfigurationError`][consumer_idem.ConfigurationError])
    rather than let every
    request through unprotected; ``router=`` names the app or router whose routes decide.

    Refusing to start: a set-up that cannot keep these promises is kept as ``refusal`` and
    fails the ASGI lifespan startup with its message (``consumer_idem.http_refusal``), so
    ``uvicorn app:app`` exits at start-up in its default lifespan mode.
    """

    def __init__(
        self,
        app: ASGIApp | StarletteASGIApp,
        store: PostgresStore | Callable[[], PostgresStore],
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        mode: Mode = "transactional",
        caller: Caller | None = None,
        shared_keys: bool = False,
        stored_headers: Iterable[str] = ("content-type", "location", "etag", "cache-control"),
        lease: float = 30.0,
        lock_timeout_ms: int = 250,
        fail_open: bool = False,
        max_body: int = 1 << 20,
        wait: float = 0.0,
        metrics: Metrics | None = None,
        tenant: Caller | None = None,
        router: Any = None,
        on_execute: RequestHook | None = None,
        on_replay: RequestHook | None = None,
    ) -> None:
        if tenant is not None:
            warnings.warn(
                "IdempotencyMiddleware(tenant=...) is now caller=... (it gets the request's"
                " HTTPConnection, which still reads like the scope: conn['headers'])",
                DeprecationWarning,
                stacklevel=2,
            )
            caller = caller or tenant
        #: what is wrong with this set-up: the server refuses to start with it (a lifespan
        #: startup that fails), as Starlette builds middlewares at start-up, not at import
        self.refusal: ConfigurationError | None = None
        try:
            routes_from = _checked_setup(app, caller, shared_keys, mode, wait, router)
        except ConfigurationError as exc:
            self.refusal, routes_from = exc, None
        self.app: Any = app  # any ASGI app: a Starlette app, or middleware around one
        self.router = routes_from
        self._store = store
        self.methods = {m.upper() for m in methods}
        self.required = required
        self.mode: Mode = mode
        self.caller = caller
        self.shared_keys = shared_keys
        self.stored_headers = {h.lower().encode() for h in stored_headers}
        self.lease = lease
        self.lock_timeout_ms = lock_timeout_ms
        self.fail_open = fail_open
        self.max_body = max_body
        self.wait = wait
        self._metrics = metrics
        #: every route's hooks, unless the route names its own (`idempotent(on_execute=...)`)
        self.on_execute, self.on_replay = on_execute, on_replay
        #: the keys this middleware's requests hold in this process (see fail-open)
        self.held_keys = HeldKeys(lease)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.refusal is not None:
            await http_refusal.refuse(self.refusal, scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        request = await admit(self, scope, receive, send)
        if request is not None:
            await request.handle()

    @property
    def store(self) -> PostgresStore:
        """The store, or a factory of it (an app that creates its pool at start-up)."""
        return self._store if isinstance(self._store, PostgresStore) else self._store()

    def caller_of(self, scope: Scope, hosts: Iterable[str] = ()) -> str:
        """The caller part of a request's record scope; followed by the concrete host(s) when
        routing depends on the host (``acme|a.shop.example``): two hosts are two key spaces.
        A ``caller=`` value, a principal (``u.<identity>``) and no caller (``anonymous``) are
        three namespaces: no value of one is a label of another."""
        return caller_of(self.caller, scope, hosts)

    def count(self, method: str, route: str, outcome: str) -> None:
        """Count a request's outcome (metrics and the request's span)."""
        metrics = self._metrics
        if metrics is None:
            with contextlib.suppress(Exception):  # a store factory before start-up
                metrics = self.store.metrics
        if metrics is not None:
            metrics.http_request(method, route, outcome)
        tracing.outcome(outcome)

    async def _run_app(self, request: KeyedRequest, context: IdempotencyContext) -> Captured:
        """Run the endpoint of ``request``; its response is captured, not sent (see
        `consumer_idem.http.capture`)."""
        captured = Captured(request.send)
        if request.watched:
            context.began = False  # until the endpoint begins (see _compat)
        token = running.set(context)
        try:
            with tracing.step("handler"):
                await self.app(endpoint_scope(request.scope, context), request.receive, captured)
        finally:
            running.reset(token)
        return captured
