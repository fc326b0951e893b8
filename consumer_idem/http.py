"""``Idempotency-Key`` for HTTP: a plain ASGI middleware for Starlette and FastAPI.

For POST and PATCH (by default) carrying ``Idempotency-Key`` (a Structured-Field string
``"..."`` or a bare token): the first request runs and its response (status, chosen headers,
body) is stored with the idempotency record before a byte of it is sent; a retry gets the same
response byte for byte with ``Idempotent-Replayed: true``. Problems are problem+json:

* 400: a route that requires the key got none, or the key is malformed;
* 422: the key was used before with another request (method + route + canonical body);
* 409 + ``Retry-After``: the first request is still in flight; 409 with its own type: the outcome
  of the first request is ``unknown`` (being reconciled);
* 503: the store is unavailable (fail-closed; a route may opt into fail-open).

Routes opt in or out with ``@idempotent(...)`` / ``@not_idempotent`` on the endpoint. Two modes:

* ``transactional`` (default): the claim, the endpoint's writes on
  ``request.state.idempotency.connection`` and the stored response commit together. A 5xx or an
  exception rolls everything back: ``failed_retryable``, the retry runs again.
* ``two_phase``, for endpoints that call out (a payment gateway): the claim commits with a lease;
  local rows registered with ``request.state.idempotency.add_write(fn)`` commit with the stored
  response. ``Retryable`` -> ``failed_retryable`` (503); a 5xx or any other exception may have
  charged: ``unknown``, reconciled (e.g. by the gateway's webhook).

A streaming response (more than one body chunk) is committed with its status and headers only,
then streamed through unstored; its replays say so in ``Idempotency-Stored: headers-only``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import asyncpg

from consumer_idem.errors import (
    InvalidKey,
    KeyInFlight,
    LeaseLost,
    Retryable,
    StoreUnavailable,
)
from consumer_idem.execution import Attempt, _rollback
from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_json
from consumer_idem.store import PostgresStore
from consumer_idem.types import Decision, DecisionKind, StoredResponse

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Mode = Literal["transactional", "two_phase"]

PROBLEM_TYPE = "urn:consumer-idem:problem:"
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~:/=-]{1,255}")
HEADER = b"idempotency-key"


class KeyHeaderError(ValueError):
    pass


def parse_key_header(value: str) -> str:
    """The key from an ``Idempotency-Key`` header: an RFC 8941 string (``"abc"``, with ``\\"``
    and ``\\\\`` escapes, printable ASCII) or a bare token. 1 to 255 characters."""
    value = value.strip()
    if value.startswith('"'):
        if len(value) < 2 or not value.endswith('"'):
            raise KeyHeaderError("unterminated structured-field string")
        out: list[str] = []
        inner, i = value[1:-1], 0
        while i < len(inner):
            ch = inner[i]
            if ch == "\\":
                i += 1
                if i >= len(inner) or inner[i] not in '"\\':
                    raise KeyHeaderError("bad escape in structured-field string")
                out.append(inner[i])
            elif ch == '"' or not 0x20 <= ord(ch) <= 0x7E:
                raise KeyHeaderError("structured-field strings hold printable ASCII only")
            else:
                out.append(ch)
            i += 1
        key = "".join(out)
    elif _TOKEN.fullmatch(value):
        key = value
    else:
        raise KeyHeaderError("the key must be a quoted string or a token of [A-Za-z0-9._~:/=-]")
    if not 1 <= len(key) <= 255:
        raise KeyHeaderError("the key must be 1 to 255 characters long")
    return key


@dataclass(frozen=True)
class RouteOptions:
    enabled: bool = True
    required: bool | None = None
    mode: Mode | None = None
    fail_open: bool | None = None


def idempotent(
    *, required: bool | None = None, mode: Mode | None = None, fail_open: bool | None = None
) -> Callable[[Any], Any]:
    """Per-route options (``None`` keeps the middleware's default)."""

    def mark(endpoint: Any) -> Any:
        endpoint.__consumer_idem__ = RouteOptions(True, required, mode, fail_open)
        return endpoint

    return mark


def not_idempotent(endpoint: Any) -> Any:
    """This route never takes part, even for POST with a key."""
    endpoint.__consumer_idem__ = RouteOptions(enabled=False)
    return endpoint


@dataclass
class IdempotencyContext:
    """``request.state.idempotency`` inside an idempotent request."""

    scope: str
    key: str
    mode: Mode
    #: transactional mode: the open transaction; write your rows here
    connection: asyncpg.Connection | None = None
    #: two-phase mode: pass this to the external system as its own idempotency key
    downstream_key: str | None = None
    writes: list[Callable[[asyncpg.Connection], Awaitable[Any]]] = field(default_factory=list)

    def add_write(self, write: Callable[[asyncpg.Connection], Awaitable[Any]]) -> None:
        """Two-phase mode: a local write committed together with the stored response."""
        self.writes.append(write)


@dataclass
class _Captured:
    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    streaming: bool = False


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str = "",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(
        {"type": PROBLEM_TYPE + kind, "title": title, "status": status, "detail": detail}
    ).encode()
    return status, [(b"content-type", b"application/problem+json"), *headers], body


class IdempotencyMiddleware:
    """Wrap a Starlette/FastAPI app: ``app.add_middleware(IdempotencyMiddleware, store=store)``.

    ``tenant(scope)`` names the caller (tenant or user) so keys never collide across tenants;
    the record's scope is ``http:<tenant>:<METHOD> <route template>``.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: PostgresStore | Callable[[], PostgresStore],
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        mode: Mode = "transactional",
        tenant: Callable[[Scope], str] | None = None,
        stored_headers: Iterable[str] = ("content-type", "location", "etag", "cache-control"),
        lease: float = 30.0,
        lock_timeout_ms: int = 250,
        fail_open: bool = False,
        max_body: int = 1 << 20,
    ) -> None:
        self.app = app
        self._store = store
        self.methods = {m.upper() for m in methods}
        self.required = required
        self.mode = mode
        self.tenant = tenant or (lambda scope: "public")
        self.stored_headers = {h.lower().encode() for h in stored_headers}
        self.lease = lease
        self.lock_timeout_ms = lock_timeout_ms
        self.fail_open = fail_open
        self.max_body = max_body

    @property
    def store(self) -> PostgresStore:
        """The store, or a factory of it (an app that creates its pool at start-up)."""
        return self._store if isinstance(self._store, PostgresStore) else self._store()

    # --- routing -------------------------------------------------------------------------------

    @staticmethod
    def _route(scope: Scope) -> tuple[str, RouteOptions] | None:
        from starlette.routing import Match

        app = scope.get("app")
        routes = getattr(getattr(app, "router", None), "routes", None) or []
        for route in routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                endpoint = getattr(route, "endpoint", None)
                options: RouteOptions = getattr(endpoint, "__consumer_idem__", RouteOptions())
                return str(getattr(route, "path", scope["path"])), options
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        routed = self._route(scope)
        if routed is None or not routed[1].enabled:
            await self.app(scope, receive, send)
            return
        template, options = routed
        raw = next((v for k, v in scope["headers"] if k == HEADER), None)
        required = self.required if options.required is None else options.required
        if raw is None:
            if required:
                await _send(
                    send,
                    *problem(
                        400,
                        "idempotency-key-missing",
                        "Idempotency-Key header required",
                        f"{scope['method']} {template} needs one",
                    ),
                )
                return
            await self.app(scope, receive, send)
            return
        try:
            key = parse_key_header(raw.decode("latin-1"))
            body = await _read_body(receive, self.max_body)
        except KeyHeaderError as exc:
            await _send(
                send, *problem(400, "idempotency-key-invalid", "Invalid Idempotency-Key", str(exc))
            )
            return
        except _TooLarge:
            await _send(send, *problem(413, "body-too-large", "Request body too large"))
            return
        record_scope = f"http:{self.tenant(scope)}:{scope['method']} {template}"
        try:
            self.store.check(record_scope, key)
        except InvalidKey as exc:
            await _send(
                send, *problem(400, "idempotency-key-invalid", "Invalid Idempotency-Key", str(exc))
            )
            return
        fingerprint = _fingerprint(scope, template, body)
        mode = options.mode or self.mode
        fail_open = self.fail_open if options.fail_open is None else options.fail_open
        started = _Started(send)
        # the body was read to fingerprint it: the app reads it again, then the real receive
        replayed = _replay_body(body, receive)
        try:
            if mode == "two_phase":
                await self._two_phase(scope, started, replayed, record_scope, key, fingerprint)
            else:
                await self._transactional(scope, started, replayed, record_scope, key, fingerprint)
        except StoreUnavailable as exc:
            if started.started:
                raise
            if fail_open:  # this route asked for it explicitly
                await self.app(
                    scope,
                    _replay_body(body, receive),
                    _with_header(send, b"idempotency-status", b"bypassed"),
                )
                return
            await _send(
                send,
                *problem(
                    503,
                    "store-unavailable",
                    "Idempotency store unavailable",
                    str(exc),
                    [(b"retry-after", b"5")],
                ),
            )

    # --- the two modes -------------------------------------------------------------------------

    async def _transactional(
        self,
        scope: Scope,
        send: _Started,
        receive: Receive,
        record_scope: str,
        key: str,
        fingerprint: str,
    ) -> None:
        store = self.store
        async with store.connection() as conn:
            try:
                claimed = await store.begin_and_claim(
                    conn, record_scope, key, fingerprint, lock_timeout_ms=self.lock_timeout_ms
                )
                token = None
                if not claimed:
                    decision = await store.reserve(record_scope, key, fingerprint, conn=conn)
                    if decision.kind is not DecisionKind.EXECUTE:
                        await conn.execute("COMMIT")
                        await self._answer(send, decision)
                        return
                    token = decision.token
            except KeyInFlight:
                await _rollback(conn)
                await _send(
                    send,
                    *problem(
                        409,
                        "request-in-progress",
                        "Request in progress",
                        "a request with this key is being processed",
                        [(b"retry-after", b"1")],
                    ),
                )
                return
            context = IdempotencyContext(record_scope, key, "transactional", connection=conn)

            async def commit(captured: _Captured) -> None:
                response = self._stored(captured)
                if token is None:
                    await store.attach_response(conn, record_scope, key, response)
                else:
                    await store.complete(
                        record_scope, key, token, None, response=response, conn=conn
                    )
                await conn.execute("COMMIT")

            try:
                captured = await self._run_app(scope, receive, context, send, commit)
            except Exception:
                await _rollback(conn)
                await store.record_failure(
                    record_scope,
                    key,
                    fingerprint,
                    "failed_retryable",
                    "exception in endpoint",
                    conn=conn,
                )
                raise
            if captured.streaming:
                return  # committed at the first chunk, then streamed through
            if captured.status >= 500:  # nothing of it is committed: it may run again
                await _rollback(conn)
                await store.record_failure(
                    record_scope,
                    key,
                    fingerprint,
                    "failed_retryable",
                    f"http {captured.status}",
                    conn=conn,
                )
            else:
                await commit(captured)
            await send.response(captured.status, captured.headers, bytes(captured.body))

    async def _two_phase(
        self,
        scope: Scope,
        send: _Started,
        receive: Receive,
        record_scope: str,
        key: str,
        fingerprint: str,
    ) -> None:
        store = self.store
        decision = await store.reserve(record_scope, key, fingerprint, lease=self.lease)
        if decision.kind is not DecisionKind.EXECUTE:
            await self._answer(send, decision)
            return
        token = decision.token
        attempt = Attempt(record_scope, key, token, decision.record.attempts)
        context = IdempotencyContext(
            record_scope, key, "two_phase", downstream_key=attempt.downstream_key
        )

        async def commit(captured: _Captured) -> None:
            async with store.connection() as conn, conn.transaction():
                for write in context.writes:
                    await write(conn)
                await store.complete(
                    record_scope, key, token, None, response=self._stored(captured), conn=conn
                )

        try:
            captured = await self._run_app(scope, receive, context, send, commit)
        except Retryable as exc:
            await store.fail_retryable(record_scope, key, token, str(exc))
            await _send(
                send,
                *problem(
                    503, "retryable", "Temporarily unavailable", str(exc), [(b"retry-after", b"1")]
                ),
            )
            return
        except BaseException as exc:  # the external call may have happened
            await asyncio.shield(
                store.mark_unknown(record_scope, key, token, f"{type(exc).__name__}: {exc}"[:500])
            )
            raise
        if captured.streaming:
            return
        if captured.status >= 500:
            await store.mark_unknown(record_scope, key, token, f"http {captured.status}")
        else:
            with contextlib.suppress(LeaseLost):  # fenced out: already unknown, reconciled later
                await commit(captured)
        await send.response(captured.status, captured.headers, bytes(captured.body))

    async def _run_app(
        self,
        scope: Scope,
        receive: Receive,
        context: IdempotencyContext,
        send: _Started,
        commit: Callable[[_Captured], Awaitable[None]],
    ) -> _Captured:
        captured = _Captured()
        inner = dict(scope)
        inner["state"] = {**(scope.get("state") or {}), "idempotency": context}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured.status = message["status"]
                captured.headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if captured.streaming:
                    await send.raw(message)
                elif message.get("more_body", False):
                    # a stream: commit what is known (status, headers), then pass it through
                    captured.streaming = True
                    await commit(captured)
                    await send.raw(
                        {
                            "type": "http.response.start",
                            "status": captured.status,
                            "headers": [
                                *captured.headers,
                                (b"idempotency-stored", b"headers-only"),
                            ],
                        }
                    )
                    await send.raw(
                        {
                            "type": "http.response.body",
                            "body": bytes(captured.body) + chunk,
                            "more_body": True,
                        }
                    )
                else:
                    captured.body += chunk

        await self.app(inner, receive, capture)
        return captured

    def _stored(self, captured: _Captured) -> StoredResponse:
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in captured.headers
            if k.lower() in self.stored_headers
        }
        if captured.streaming:
            headers["idempotency-stored"] = "headers-only"
        return StoredResponse(
            captured.status, headers, b"" if captured.streaming else bytes(captured.body)
        )

    async def _answer(self, send: _Started, decision: Decision) -> None:
        record = decision.record
        if decision.kind is DecisionKind.REPLAY:
            stored = record.response
            if stored is None:  # resolved without a response: give the stored result
                stored = StoredResponse(
                    200,
                    {"content-type": "application/json"},
                    (record.result_json or "null").encode(),
                )
            headers = [
                (k.encode("latin-1"), v.encode("latin-1")) for k, v in stored.headers.items()
            ]
            await send.response(
                stored.status, [*headers, (b"idempotent-replayed", b"true")], stored.body
            )
        elif decision.kind is DecisionKind.MISUSE:
            await _send(
                send,
                *problem(
                    422,
                    "idempotency-key-reused",
                    "Idempotency-Key reused with another request",
                    "this key was used with a different method, route or body",
                ),
            )
        elif decision.kind is DecisionKind.IN_PROGRESS:
            wait = str(max(1, math.ceil(decision.retry_after))).encode()
            await _send(
                send,
                *problem(
                    409,
                    "request-in-progress",
                    "Request in progress",
                    "a request with this key is being processed",
                    [(b"retry-after", wait)],
                ),
            )
        else:  # UNKNOWN
            await _send(
                send,
                *problem(
                    409,
                    "outcome-unknown",
                    "Outcome being reconciled",
                    "the first request's outcome is not known yet",
                    [(b"retry-after", b"30")],
                ),
            )


class _TooLarge(Exception):
    pass


class _Started:
    """``send``, remembering whether a response has begun (then no problem can be sent)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def raw(self, message: Message) -> None:
        self.started = True
        await self._send(message)

    async def response(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.raw({"type": "http.response.start", "status": status, "headers": headers})
        await self.raw({"type": "http.response.body", "body": body, "more_body": False})


async def _send(
    send: Send | _Started, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    target = send if isinstance(send, _Started) else _Started(send)
    await target.response(status, headers, body)


async def _read_body(receive: Receive, limit: int) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        if len(body) > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            break
    return bytes(body)


def _replay_body(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def again() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return wrapped


def _fingerprint(scope: Scope, template: str, body: bytes) -> str:
    """method + route template + the body (canonical JSON when it is JSON, else raw bytes)."""
    try:
        value = json.loads(body) if body else None
        return fingerprint_json({"method": scope["method"], "route": template, "body": value})
    except (ValueError, UnicodeDecodeError):  # not JSON, or JSON RFC 8785 cannot canonicalise
        return fingerprint_bytes(f"{scope['method']} {template}\n".encode() + body)
