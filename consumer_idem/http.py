"""``Idempotency-Key`` for HTTP: a plain ASGI middleware for Starlette and FastAPI.

For POST and PATCH (by default) carrying ``Idempotency-Key`` (a Structured-Field string
``"..."``, parameters allowed and ignored, or a bare token): the first request runs and its
response (status, chosen headers, body) is stored with the idempotency record before a byte of
it is sent; a retry gets the same response byte for byte with ``Idempotent-Replayed: true``.
Nothing runs on a part of a body: a client that disconnects before its last chunk gets no
claim, no run and no record (its retry is a first request).

What a record covers. Its scope is the caller, the method and the route template
(``http:<caller>:POST /orders/{order_id}``); its fingerprint is the concrete request: method,
path with its parameters, query string (parameters sorted by name) and body (canonical JSON, or
raw bytes; JSON nested past :data:`~consumer_idem.fingerprint.MAX_DEPTH` is raw bytes too).
The same key for another concrete request is a 422, never a replay. Routes are resolved the
way Starlette's router resolves them (mounts, hosts, sub-applications, FastAPI's included
routers), through any middleware between this one and the app (followed by ``.app``); a
middleware that cannot see the routes refuses to start. When routing depends on the host (a
``Host`` route matched), the concrete host is part of the record scope (``http:<caller>|<host>:
...``: each host its own key space) and of the fingerprint. The caller is what ``caller=``
returns, else the principal Starlette's ``AuthenticationMiddleware`` put in ``scope["user"]``;
requests with neither share the ``anonymous`` key space, which the middleware accepts only when
told so (``shared_keys=True``). A ``caller=`` label is the value itself (percent-encoded) or,
past 64 characters, ``sha256.<hash>``; a principal's is ``u.<identity>``; none is
``anonymous``: no label of one source is a label of another. A request no route matches (at
this middleware's scope) is protected under its raw path.

Problems are problem+json:

* 400: a route that requires the key got none, or the key is malformed or sent twice, or
  ``caller=`` failed (``caller-unknown``);
* 422: the key was used before with another request;
* 409 + ``Retry-After``: the first request is still in flight (a route may ``wait`` for it
  instead); 409 with its own type: the outcome of the first request is ``unknown``;
* 500 ``request-not-committed``: the endpoint's transaction was rolled back (nothing stored);
* 503 ``store-unavailable``: the store failed before the endpoint ran (fail-closed; a route
  may opt into fail-open: see :meth:`IdempotencyMiddleware._may_bypass` for the narrow case);
* 503 ``outcome-unknown``: the endpoint ran, but its outcome could not be recorded (a
  two-phase completion failed, or the store failed after the endpoint ran): never "not
  processed", and the retry never applies it twice.

Routes opt in or out with ``@idempotent(...)`` / ``@not_idempotent`` on the endpoint. Two modes,
both driven by the claim engine (:mod:`consumer_idem.claim`):

* ``transactional`` (default): the claim, the endpoint's writes on
  ``request.state.idempotency.connection`` and the stored response commit together. A 5xx, an
  exception or a commit Postgres rolled back leaves nothing: ``failed_retryable``, the retry runs.
* ``two_phase``, for endpoints that call out (a payment gateway): the claim commits with a lease;
  local rows registered with ``request.state.idempotency.add_write(fn)`` commit with the stored
  response. ``Retryable`` -> ``failed_retryable`` (503); a 5xx or any other exception may have
  charged: ``unknown``, reconciled (e.g. by the gateway's webhook).

A streaming response (more than one body chunk) is passed through as it comes, but its last
message is held back until the outcome is settled: committed with its status and headers only
(replays say ``Idempotency-Stored: headers-only``) once the stream ended well, in the same
transaction as writes the stream made; a 5xx stream is rolled back (transactional) or parked
``unknown`` (two-phase), like any 5xx; a stream that dies mid-way, or whose outcome cannot be
committed, is cut short (the client sees a broken response, never a complete one) and never
stored as a success.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import starlette  # noqa: F401 - the http extra
except ImportError as exc:
    raise missing("http", exc, __name__) from exc

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import math
import re
import socket
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, quote, urlencode

import asyncpg
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.routing import Host, Match, Mount
from starlette.types import ASGIApp as StarletteASGIApp

from consumer_idem import http_refusal, tracing
from consumer_idem.claim import (
    TransactionalClaim,
    TwoPhaseClaim,
    is_lock_timeout,
    waiters_for,
)
from consumer_idem.downstream import downstream_key_for as downstream_key_for
from consumer_idem.errors import (
    CommitRolledBack,
    ConfigurationError,
    InvalidKey,
    KeyHeaderError,
    KeyInFlight,
    LeaseLost,
    NotInTransaction,
    Retryable,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
    StreamCutShort,
)
from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_json, parse_json
from consumer_idem.metrics import Metrics
from consumer_idem.outbox import UnitOutbox, outbox_for
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Decision, DecisionKind, OutcomeKind, StoredResponse

log = logging.getLogger("consumer_idem.http")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Mode = Literal["transactional", "two_phase"]
#: names the caller of a request (a tenant, a user, an API key's id); ``None``: no caller
Caller = Callable[[HTTPConnection], str | None]

PROBLEM_TYPE = "urn:consumer-idem:problem:"
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~:/=-]{1,255}")
#: one RFC 8941 parameter: ``;key`` or ``;key=bare-item``
_PARAMETER = re.compile(
    r";[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:"
    r'"(?:[^"\\\x00-\x1f\x7f-\uffff]|\\["\\])*"'  # string
    r"|\?[01]"  # boolean
    r"|-?[0-9]{1,15}(?:\.[0-9]{1,3})?"  # integer or decimal
    r"|[A-Za-z*][A-Za-z0-9!#$%&'*+.^_`|~:/-]*"  # token
    r"|:[A-Za-z0-9+/]*={0,2}:"  # byte sequence
    r"))?"
)
HEADER = b"idempotency-key"
ANONYMOUS = "anonymous"
#: how long a re-check of a waiting request may wait on a row lock: it must not hold the
#: connection while the first request runs (it is woken when that one commits)
RECHECK_LOCK_TIMEOUT_MS = 20
#: keys whose endpoint ran in this process without a settled record: at most this many are
#: remembered (oldest dropped first), each for the lease or 5 minutes, whichever is longer
UNSETTLED_MAX = 10_000
UNSETTLED_MIN_TTL = 300.0


def parse_key_header(value: str) -> str:
    """The key from an ``Idempotency-Key`` header: an RFC 8941 string item (``"abc"``, with
    ``\\"`` and ``\\\\`` escapes, printable ASCII; parameters such as ``;v=1`` are allowed and do
    not change the key) or a bare token. 1 to 255 characters."""
    value = value.strip(" \t")
    if value.startswith('"'):
        out: list[str] = []
        i = 1
        while True:
            if i >= len(value):
                raise KeyHeaderError("unterminated structured-field string")
            ch = value[i]
            if ch == "\\":
                i += 1
                if i >= len(value) or value[i] not in '"\\':
                    raise KeyHeaderError("bad escape in structured-field string")
                out.append(value[i])
            elif ch == '"':
                break
            elif not 0x20 <= ord(ch) <= 0x7E:
                raise KeyHeaderError("structured-field strings hold printable ASCII only")
            else:
                out.append(ch)
            i += 1
        rest = value[i + 1 :]
        while rest:
            parameter = _PARAMETER.match(rest)
            if parameter is None:
                raise KeyHeaderError("one structured-field string, optionally with parameters")
            rest = rest[parameter.end() :]
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
    wait: float | None = None


def idempotent(
    *,
    required: bool | None = None,
    mode: Mode | None = None,
    fail_open: bool | None = None,
    wait: float | None = None,
) -> Callable[[Any], Any]:
    """Per-route options (``None`` keeps the middleware's default). ``wait``: seconds a
    duplicate that meets this route's first request in flight waits for its result (then
    replays it) before answering 409."""
    if wait is not None and wait < 0:
        raise ConfigurationError("wait is a number of seconds, 0 or more")

    def mark(endpoint: Any) -> Any:
        endpoint.__consumer_idem__ = RouteOptions(True, required, mode, fail_open, wait)
        return endpoint

    return mark


def not_idempotent(endpoint: Any) -> Any:
    """This route (or every route of this mounted application) never takes part, even for POST
    with a key."""
    endpoint.__consumer_idem__ = RouteOptions(enabled=False)
    return endpoint


def _options(target: Any, inherited: RouteOptions) -> RouteOptions:
    options = getattr(target, "__consumer_idem__", None)
    return options if isinstance(options, RouteOptions) else inherited


try:  # FastAPI keeps an included router as one route of its own; this flattens it
    from fastapi.routing import iter_route_contexts as _route_contexts
except ImportError:  # pragma: no cover - Starlette without FastAPI, or a FastAPI that flattens
    _route_contexts = None  # type: ignore[assignment]


def _candidates(routes: Iterable[Any]) -> Iterable[tuple[Any, Any]]:
    """(route to match, route as the user declared it), in the router's order. FastAPI's
    ``iter_route_contexts`` (what its OpenAPI generation walks) gives an included router's
    routes with their prefixes applied."""
    if _route_contexts is None:
        return ((route, route) for route in routes)
    return ((ctx, ctx.original_route) for ctx in _route_contexts(list(routes)))


@dataclass(frozen=True)
class Routed:
    """Where a request goes: the full route ``template``, its ``options``, and ``hosts``: the
    concrete hosts of the ``Host`` routes with parameters it went through (empty when routing
    did not depend on the host, or only on a fixed host the template names already), each as
    the router matched it (the pattern with its parameters filled in)."""

    template: str
    options: RouteOptions
    hosts: tuple[str, ...] = ()


def resolve_route(app: Any, scope: Scope) -> tuple[str, RouteOptions] | None:
    """The route ``scope`` goes to, as (template, options), or ``None`` when no route matches.

    Resolved with the routers' own pieces, as Starlette's router does: the first route whose
    ``matches()`` is a full match wins; a ``Mount`` or ``Host`` hands the request on to its
    routes with the child scope merged in (FastAPI's included routers are flattened with their
    prefixes first). The template is the full path template (mount and router prefixes
    included, ``//<host pattern>`` in front under a ``Host``).
    """
    routed = route_of(app, scope)
    return None if routed is None else (routed.template, routed.options)


def route_of(app: Any, scope: Scope) -> Routed | None:
    """:func:`resolve_route`, with the concrete hosts routing depended on."""
    router = getattr(app, "router", app)
    return _resolve(getattr(router, "routes", None) or (), scope, "", RouteOptions(), ())


def _matched_host(route: Host, child: Scope) -> str:
    """The host as ``route`` matched it: its pattern with the matched parameters filled in
    (``{tenant}.shop.example`` -> ``a.shop.example``), exactly what the endpoint sees."""
    params = child.get("path_params", {})
    try:
        values = {
            name: convertor.to_string(params[name])
            for name, convertor in route.param_convertors.items()
        }
        return str(route.host_format.format(**values))
    except (AttributeError, KeyError, ValueError, IndexError):  # pragma: no cover - old Starlette
        return str(Headers(scope=child).get("host", "")).split(":")[0]


def _resolve(
    routes: Iterable[Any],
    scope: Scope,
    prefix: str,
    inherited: RouteOptions,
    hosts: tuple[str, ...],
) -> Routed | None:
    for route, declared in _candidates(routes):
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        if isinstance(declared, Mount | Host):
            if isinstance(declared, Mount):
                inner_prefix = prefix + route.path
            else:
                inner_prefix = prefix + f"//{route.host}"
                if getattr(route, "param_convertors", True):  # a fixed host is the template's
                    hosts = (*hosts, _matched_host(route, {**scope, **child}))
            mounted = getattr(declared, "_base_app", declared.app)
            options = _options(mounted, _options(declared.app, inherited))
            inner = route.routes
            if not options.enabled or not inner:
                return Routed(inner_prefix or "/", options, hosts)
            # Starlette hands the request to the first full match, even if nothing inside it
            # matches (a 404 from the inner router): so do we
            return _resolve(inner, {**scope, **child}, inner_prefix, options, hosts)
        endpoint = getattr(route, "endpoint", None)
        return Routed(
            prefix + str(getattr(route, "path", "")), _options(endpoint, inherited), hosts
        )
    return None


def find_router(app: Any) -> Any | None:
    """The router whose routes decide for ``app``: the app itself (a ``Starlette``, a
    ``FastAPI``, a ``Router``), or the one behind the middleware wrapping it (each keeps the
    application it wraps as ``.app``: GZip, CORS, Sentry, Starlette's own stack)."""
    seen: set[int] = set()
    node = app
    while node is not None and id(node) not in seen and len(seen) < 64:
        seen.add(id(node))
        router = getattr(node, "router", node)
        if isinstance(getattr(router, "routes", None), list | tuple):
            return node
        node = getattr(node, "app", None)
    return None


def _canonical_target(method: str, path: str, query_string: bytes) -> str:
    """``METHOD /path?query``, ASCII: the path percent-encoded, the query parameters decoded,
    sorted by name (repeated names keep their order) and encoded again."""
    target = quote(path, safe="/:@!$&'()*+,;=~", errors="surrogatepass")
    if query_string:
        pairs = parse_qsl(
            query_string.decode("latin-1"),
            keep_blank_values=True,
            encoding="utf-8",
            errors="surrogateescape",
        )
        pairs.sort(key=lambda pair: pair[0])
        query = urlencode(pairs, quote_via=quote, encoding="utf-8", errors="surrogateescape")
        target += "?" + query
    return f"{method} {target}"


def request_fingerprint(
    method: str, path: str, query_string: bytes, body: bytes, *, host: str | None = None
) -> str:
    """What the record's fingerprint covers: the concrete request. Method, path with its
    parameters, canonical query string, the host when routing depended on it (a ``Host``
    route), and the body (RFC 8785 canonical JSON when it is JSON, else its raw bytes)."""
    target = _canonical_target(method, path, query_string)
    if host:  # the target has no raw space after the method: this cannot be forged by a path
        target += " host=" + quote(host, safe="", errors="surrogatepass")
    try:
        value = parse_json(body) if body else None
        return fingerprint_json({"request": target, "body": value})
    except ValueError:  # not JSON (or UTF-8), too deep, or JSON RFC 8785 cannot canonicalise
        return fingerprint_bytes(target.encode() + b"\n" + body)


def principal(scope: Scope) -> str | None:
    """The authenticated user Starlette's ``AuthenticationMiddleware`` put in the scope, as
    ``user:<identity>``; ``None`` when there is none or it is not authenticated."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:  # a BaseUser that names itself only by display_name
        identity = user.display_name
    return f"user:{identity}" if identity else None


_HASHED = "sha256."


def _caller_label(value: str) -> str:
    """The caller (or a host) as it goes into the record scope: readable, no ``:`` (the
    scope's separator, so metrics can drop the caller) and no ``|`` (the host separator),
    bounded. A long one is replaced by ``sha256.<hash>``; a verbatim label never starts
    that way (its ``s`` is percent-encoded, which ``quote`` never does by itself), so a
    caller cannot pick a name that shares another caller's hashed key space."""
    label = quote(value, safe="@._-+~!$&'()*,;=/", errors="surrogatepass")
    if len(label) > 64:
        return _HASHED + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    if label.startswith(_HASHED):
        return "%73" + label[1:]
    return label


#: a principal's label: ``u.<identity>``; a ``caller=`` value never starts so (nor is it
#: ``anonymous``): each source of a caller is its own namespace
_PRINCIPAL = "u."


def _callers_label(value: str) -> str:
    """A value of ``caller=``: :func:`_caller_label`, except that its first character is
    percent-encoded (which ``quote`` never does to a letter) when the label would read
    ``anonymous`` (no caller) or ``u.`` (a principal): no caller value shares their keys."""
    label = _caller_label(value)
    if label == ANONYMOUS or label.startswith(_PRINCIPAL):
        return f"%{ord(label[0]):02X}{label[1:]}"
    return label


def _principal_label(identity: str) -> str:
    """An authenticated principal's label: ``u.`` and its identity's :func:`_caller_label`."""
    return _PRINCIPAL + _caller_label(identity)


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


def idempotency_of(conn: HTTPConnection) -> IdempotencyContext | None:
    """The request's :class:`IdempotencyContext` (``request.state.idempotency``), typed;
    ``None`` when the middleware does not protect this request."""
    context = conn.scope.get("state", {}).get("idempotency")
    return context if isinstance(context, IdempotencyContext) else None


def transaction_of(conn: HTTPConnection) -> asyncpg.Connection:
    """The connection of the request's idempotency transaction (transactional routes): write
    here to commit with the stored response. Raises :class:`NotInTransaction` otherwise."""
    context = idempotency_of(conn)
    if context is None or context.connection is None:
        why = (
            "it carries no Idempotency-Key (or its route is not idempotent)"
            if context is None
            else f"its route is {context.mode}"
            if context.mode != "transactional"
            else "it runs unprotected (fail-open: the store was unreachable)"
        )
        raise NotInTransaction(f"this request has no idempotency transaction: {why}")
    return context.connection


def outbox_of(conn: HTTPConnection) -> UnitOutbox:
    """The outbox of the request's idempotency transaction (transactional routes): what the
    endpoint publishes there is sent once the response is committed, never for a request that
    rolled back, never again for a replay. Also a FastAPI dependency
    (``outbox: UnitOutbox = Depends(outbox_of)``). Raises :class:`NotInTransaction` where
    :func:`transaction_of` does. Attach a sender for it at startup
    (``consumer_idem.outbox.OutboxService``)."""
    return outbox_for(transaction_of(conn))


@dataclass
class _Captured:
    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    #: more than one body chunk: passed through as it comes, except its last message
    streaming: bool = False
    #: a stream's last body message, held back until its outcome is committed
    final: Message | None = None

    @property
    def incomplete(self) -> bool:
        """A stream the endpoint stopped before its last message."""
        return self.streaming and self.final is None


class _EndpointFailed(Exception):
    """The endpoint answered with a 5xx: not a result, nothing of it is stored."""

    def __init__(self, status: int) -> None:
        super().__init__(f"http {status}")
        self.status = status


class _StreamIncomplete(Exception):
    """The endpoint returned without the last message of its stream (cancelled when the client
    went away, say): the stream did not end well, so it is no result."""


class _ClientGone(Exception):
    """The client disconnected before the request body was complete."""


class _CallerUnknown(Exception):
    """``caller(conn)`` raised: the request does not say whose it is."""


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


def _in_progress(retry_after: float) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    wait = str(max(1, math.ceil(retry_after))).encode()
    return problem(
        409,
        "request-in-progress",
        "Request in progress",
        "a request with this key is being processed",
        [(b"retry-after", wait)],
    )


_STORE_UNAVAILABLE = problem(
    503,
    "store-unavailable",
    "Idempotency store unavailable",
    "the request was not processed; retry later",
    [(b"retry-after", b"5")],
)
_NOT_RECORDED = problem(
    503,
    "outcome-unknown",
    "Outcome being reconciled",
    "the request was processed but its outcome could not be recorded; retrying is safe",
    [(b"retry-after", b"30")],
)
_OUTCOME_UNCONFIRMED = problem(
    503,
    "outcome-unknown",
    "Outcome not confirmed",
    "the request ran, but the store failed before its outcome was recorded; retry with the"
    " same key: it is never applied twice",
    [(b"retry-after", b"5")],
)
_NOT_COMMITTED = problem(
    500,
    "request-not-committed",
    "The request's changes were not committed",
    "nothing of this request was saved; retrying runs it again",
)


#: ASGI response extensions whose messages carry no body to capture
_BY_REFERENCE = frozenset(
    ("http.response.pathsend", "http.response.zerocopysend", "http.response.trailers")
)

#: connect() errors that prove the database host cannot be reached at all: nobody connects
_UNREACHABLE = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH)


def outage_proven(exc: BaseException) -> bool:
    """Does ``exc`` (a store error, with its causes) prove the database cannot be reached?

    Only errors that can happen solely while *opening* a connection count: the connection was
    refused, the network or host is unreachable, the host name does not resolve, or the
    server says it does not accept connections now (starting up, shutting down). Then no
    statement of this request reached the database. A timeout proves nothing (a pool
    exhausted by the requests holding keys, a slow server: the store is up and someone may
    hold this very key), and neither does a connection lost mid-statement (the statement may
    have run) or a server refusing more clients (it serves others)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror | asyncpg.CannotConnectNowError):
            return True
        if isinstance(current, ConnectionRefusedError):
            return True
        if type(current) is OSError and current.errno in _UNREACHABLE:
            return True
        current = current.__cause__  # what the store wrapped: never an unrelated context
    return False


@dataclass
class _Request:
    """One request through the middleware, while it is handled."""

    scope: Scope
    receive: Receive
    send: _Started
    method: str
    route: str
    record_scope: str
    key: str
    fingerprint: str
    mode: Mode
    fail_open: bool
    wait: float
    started_at: float
    #: the endpoint has been called: from here on, fail-open may not skip protection
    ran: bool = False
    #: the store said another request holds this key: skipping protection could run it twice
    held_elsewhere: bool = False
    #: a store statement returned a decision for this request: the store is not down
    consulted: bool = False
    #: this request holds its key in the in-process registry (claimed, or bypassed)
    holding: bool = False
    #: the endpoint ran and its outcome is recorded (or nothing of it can have happened)
    settled: bool = False


def _checked_setup(
    app: Any, caller: Caller | None, shared_keys: bool, mode: str, wait: float, router: Any
) -> Any:
    """The router whose routes decide, or the :class:`ConfigurationError` of a set-up that
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
    When it cannot, it refuses to start (:class:`ConfigurationError`) rather than let every
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
        #: keys this middleware holds right now (claimed until settled, or bypassed), in this
        #: process; and those of them run unprotected (fail-open)
        self._running: dict[tuple[str, str], int] = {}
        self._bypassed: dict[tuple[str, str], int] = {}
        #: keys whose endpoint ran here without a settled record (an outcome unknown, a
        #: bypassed run): fail-open never lets them through (key -> when forgotten)
        self._unsettled: OrderedDict[tuple[str, str], float] = OrderedDict()
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

    @property
    def store(self) -> PostgresStore:
        """The store, or a factory of it (an app that creates its pool at start-up)."""
        return self._store if isinstance(self._store, PostgresStore) else self._store()

    def caller_of(self, scope: Scope, hosts: Iterable[str] = ()) -> str:
        """The caller part of a request's record scope; followed by the concrete host(s) when
        routing depends on the host (``acme|a.shop.example``): two hosts are two key spaces.
        A ``caller=`` value, a principal (``u.<identity>``) and no caller (``anonymous``) are
        three namespaces: no value of one is a label of another."""
        value = self.caller(HTTPConnection(scope)) if self.caller is not None else None
        if value:
            label = _callers_label(value)
        else:
            user = principal(scope)
            label = _principal_label(user.removeprefix("user:")) if user else ANONYMOUS
        return "|".join((label, *(_caller_label(host) for host in hosts)))

    def _hold(self, request: _Request, *, bypassed: bool = False) -> None:
        """From its claim until its outcome is settled (or while it runs bypassed), this
        process holds (scope, key)."""
        if request.holding:
            return
        request.holding = True
        held = (request.record_scope, request.key)
        self._running[held] = self._running.get(held, 0) + 1
        if bypassed:
            self._bypassed[held] = self._bypassed.get(held, 0) + 1

    def _release(self, request: _Request) -> None:
        if not request.holding:
            return
        request.holding = False
        held = (request.record_scope, request.key)
        for registry in (self._running, self._bypassed):
            if held in registry:
                left = registry.pop(held) - 1
                if left:
                    registry[held] = left

    def _held_here(self, request: _Request, registry: dict[tuple[str, str], int]) -> bool:
        """Does another request of this process hold the key?"""
        return not request.holding and (request.record_scope, request.key) in registry

    def _settle(self, request: _Request) -> None:
        request.settled = True
        self._unsettled.pop((request.record_scope, request.key), None)

    def _remember_unsettled(self, request: _Request) -> None:
        held = (request.record_scope, request.key)
        self._unsettled.pop(held, None)
        self._unsettled[held] = time.monotonic() + max(self.lease, UNSETTLED_MIN_TTL)
        while len(self._unsettled) > UNSETTLED_MAX:
            self._unsettled.popitem(last=False)

    def _is_unsettled(self, request: _Request) -> bool:
        held = (request.record_scope, request.key)
        until = self._unsettled.get(held)
        if until is None:
            return False
        if until < time.monotonic():
            del self._unsettled[held]
            return False
        return True

    def _count(self, method: str, route: str, outcome: str) -> None:
        metrics = self._metrics
        if metrics is None:
            with contextlib.suppress(Exception):  # a store factory before start-up
                metrics = self.store.metrics
        if metrics is not None:
            metrics.http_request(method, route, outcome)
        tracing.outcome(outcome)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.refusal is not None:
            await http_refusal.refuse(self.refusal, scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        routed = route_of(self.router, scope)
        if routed is None:
            # no route at this scope (a middleware further in may rewrite the path): never let
            # a keyed request through unprotected; its template is the path as it came
            raw_path = scope.get("raw_path")
            path = raw_path.decode("latin-1") if raw_path else scope["path"]
            routed = Routed(path.split("?", 1)[0], RouteOptions())
        if not routed.options.enabled:
            await self.app(scope, receive, send)
            return
        route, options = routed.template, routed.options
        method = scope["method"]
        raw = [v for k, v in scope["headers"] if k == HEADER]
        required = self.required if options.required is None else options.required
        if not raw:
            if required:
                self._count(method, route, "missing_key")
                await _send(
                    send,
                    *problem(
                        400,
                        "idempotency-key-missing",
                        "Idempotency-Key header required",
                        f"{method} {route} needs one",
                    ),
                )
                return
            await self.app(scope, receive, send)
            return
        try:
            if len(raw) > 1:  # which one would the client mean? neither is safe to guess
                raise KeyHeaderError("send one Idempotency-Key header, not several")
            key = parse_key_header(raw[0].decode("latin-1"))
            body = await _read_body(receive, self.max_body)
            try:
                caller = self.caller_of(scope, routed.hosts)
            except Exception as exc:
                raise _CallerUnknown from exc
            record_scope, key = self.store.check(f"http:{caller}:{method} {route}", key)
        except (KeyHeaderError, InvalidKey) as exc:
            self._count(method, route, "invalid_key")
            await _send(
                send, *problem(400, "idempotency-key-invalid", "Invalid Idempotency-Key", str(exc))
            )
            return
        except _TooLarge:
            await _send(send, *problem(413, "body-too-large", "Request body too large"))
            return
        except _CallerUnknown as exc:
            # the caller function failed (a header it reads is missing): whose key this is
            # cannot be told, so it takes no part; the cause goes to the log only
            self._count(method, route, "caller_unknown")
            log.warning("caller= failed for %s %s", method, route, exc_info=exc.__cause__)
            await _send(
                send,
                *problem(
                    400,
                    "caller-unknown",
                    "Caller unknown",
                    "the request does not say whose it is",
                ),
            )
            return
        except _ClientGone:
            # the body is incomplete: nothing may run on it and nothing is claimed; the client
            # is gone, so there is nobody to answer (its retry runs as a first request)
            self._count(method, route, "client_disconnected")
            log.info("client disconnected before the request body was complete")
            return
        request = _Request(
            scope=scope,
            # the body was read to fingerprint it: the app reads it again, then the real receive
            receive=_replay_body(body, receive),
            send=_Started(send),
            method=method,
            route=route,
            record_scope=record_scope,
            key=key,
            fingerprint=request_fingerprint(
                method,
                scope["path"],
                scope.get("query_string", b""),
                body,
                host="|".join(routed.hosts) or None,
            ),
            mode=options.mode or self.mode,
            fail_open=self.fail_open if options.fail_open is None else options.fail_open,
            wait=self.wait if options.wait is None else options.wait,
            started_at=time.monotonic(),
        )
        with tracing.request(scope, method, route, record_scope, key):
            try:
                await self._handle(request)
            except (StoreUnavailable, SchemaMissing, StoreRejected, CommitRolledBack) as exc:
                await self._store_failed(request, body, receive, send, exc)
            finally:
                self._release(request)
                if request.ran and not request.settled:
                    # its retry must never be let through by fail-open while the store is away
                    self._remember_unsettled(request)

    async def _store_failed(
        self, request: _Request, body: bytes, receive: Receive, send: Send, exc: Exception
    ) -> None:
        method, route = request.method, request.route
        record_scope, key = request.record_scope, request.key
        if request.send.started:
            raise exc
        if not request.ran and is_lock_timeout(exc):
            self._count(method, route, "in_progress")
            await _send(request.send, *_in_progress(1))
            return
        # the cause goes to the log, never to the client; once per episode where the store
        # said it already (a server that cannot take writes: see StoreUnavailable.said)
        said = isinstance(exc, StoreUnavailable) and exc.said
        log.log(
            logging.DEBUG if said else logging.WARNING,
            "idempotency store failed (%s): %s",
            "before the endpoint ran" if not request.ran else "after the endpoint ran",
            exc,
            extra={"scope": record_scope, "key": key},
        )
        if request.ran:
            # the endpoint ran: "not processed" would be a lie, and running it again (fail
            # open or not) could apply it twice. The retry meets the record: a replay, an
            # in-flight or unknown answer, or (transactional, nothing committed) a first run
            self._count(method, route, "store_unavailable")
            await _send(request.send, *_OUTCOME_UNCONFIRMED)
            return
        if request.fail_open and self._may_bypass(request, exc):
            if self._held_here(request, self._running):
                # this process holds the key right now: a second run is a duplicate
                self._count(method, route, "in_progress")
                await _send(request.send, *_in_progress(1))
                return
            if self._is_unsettled(request):
                # it ran here and its outcome was never recorded: never run it again
                self._count(method, route, "unknown")
                await _send(request.send, *_NOT_RECORDED)
                return
            self._count(method, route, "bypassed")
            self._hold(request, bypassed=True)
            request.ran = True  # never recorded: a retry is never bypassed again
            scope = dict(request.scope)
            scope["state"] = {
                **(request.scope.get("state") or {}),
                "idempotency": IdempotencyContext(
                    record_scope,
                    key,
                    request.mode,
                    connection=None,
                    downstream_key=downstream_key_for(record_scope, key)
                    if request.mode == "two_phase"
                    else None,
                ),
            }
            await self.app(
                scope,
                _replay_body(body, receive),
                _with_header(send, b"idempotency-status", b"bypassed"),
            )
            return
        self._count(method, route, "store_unavailable")
        await _send(request.send, *_STORE_UNAVAILABLE)

    @staticmethod
    def _may_bypass(request: _Request, exc: BaseException) -> bool:
        """Fail-open skips protection only when nothing can have happened and nobody can hold
        the key: the endpoint has not run, no store statement returned a decision (the key
        was not seen held, replayed, or in any state), and the failure proves the database
        cannot be reached at all (a refused connection, an unknown host), never a timeout."""
        return (
            not request.ran
            and not request.held_elsewhere
            and not request.consulted
            and isinstance(exc, StoreUnavailable)
            and outage_proven(exc)
        )

    # --- waiting ---------------------------------------------------------------------------------

    async def _handle(self, request: _Request) -> None:
        attempt = self._two_phase if request.mode == "two_phase" else self._transactional
        retry_after = await attempt(request, False)
        request.held_elsewhere = retry_after is not None
        if retry_after is not None and request.wait > 0:
            retry_after = await self._wait(request, attempt)
        if retry_after is not None:
            self._count(request.method, request.route, "in_progress")
            await _send(request.send, *_in_progress(retry_after))

    async def _wait(
        self, request: _Request, attempt: Callable[[_Request, bool], Awaitable[float | None]]
    ) -> float | None:
        """The key is in flight: wait until its owner settles it, then claim again (usually a
        replay), until ``request.wait`` runs out. Nothing is held meanwhile: no connection, no
        transaction. The owner's COMMIT notifies; a re-check now and then covers a notice
        that never comes (the owner's process died: its transaction rolled back)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.wait - (time.monotonic() - request.started_at)
        waiters = waiters_for(self.store)
        poll = min(0.25, waiters.poll_cap / 4)
        async with waiters.watch(request.record_scope, request.key) as woken:
            while True:
                # listening already: a settlement from here on wakes us, none slips through
                retry_after = await attempt(request, True)
                remaining = deadline - loop.time()
                if retry_after is None or remaining <= 0:
                    return retry_after
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(remaining, poll))
                woken.clear()
                poll = min(poll * 2, waiters.poll_cap)

    # --- the two modes ---------------------------------------------------------------------------

    async def _transactional(self, request: _Request, recheck: bool) -> float | None:
        """One attempt: ``None`` once the request is answered, else the seconds after which
        the request in flight may be done (nothing was sent)."""
        if self._held_here(request, self._bypassed):
            # this process runs the key unprotected: no record shows it. (A protected holder
            # is in the store: its row lock or lease answers, and a duplicate may replay it)
            return 1.0
        store = self.store
        lock_timeout = self.lock_timeout_ms
        if recheck:
            lock_timeout = min(lock_timeout, RECHECK_LOCK_TIMEOUT_MS)
        try:
            async with (
                store.connection() as conn,
                TransactionalClaim(
                    store,
                    conn,
                    request.record_scope,
                    request.key,
                    request.fingerprint,
                    lock_timeout_ms=lock_timeout,
                    domain_errors=False,  # the endpoint's 4xx responses are its domain errors
                    notify=request.wait > 0,
                ) as claim,
            ):
                request.consulted = True
                if claim.decision is not None:
                    return await self._decided(request, claim.decision)
                self._hold(request)
                await self._run_transactional(request, claim, conn)
                return None
        except KeyInFlight:
            return 1.0

    async def _run_transactional(
        self, request: _Request, claim: TransactionalClaim, conn: asyncpg.Connection
    ) -> None:
        context = IdempotencyContext(
            request.record_scope, request.key, "transactional", connection=conn
        )
        try:
            captured = await self._run_app(request, context)
        except Exception as exc:  # (a cancellation is rolled back by the claim, not recorded)
            # a stream that died mid-way included: rolled back, never a stored success
            await self._failed(request, await claim.fail(exc, "exception in endpoint"))
            raise
        if captured.incomplete:  # rolled back; the client is gone, or gets a broken response
            await self._failed(request, await claim.fail(_StreamIncomplete(), "stream incomplete"))
            self._count(request.method, request.route, "failed")
            return
        if captured.status >= 500:  # nothing of it is committed: it may run again
            failed = await claim.fail(_EndpointFailed(captured.status), f"http {captured.status}")
            await self._failed(request, failed)
            self._count(request.method, request.route, "failed")
        else:
            outcome = await claim.complete(response=self._stored(captured))
            # REPLAYED: the endpoint's own COMMIT took the claim row with its changes; they
            # exist, and the endpoint's answer describes them
            if outcome.kind not in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED):
                # Postgres did not commit (the endpoint swallowed a database error, say): the
                # endpoint's answer describes changes that do not exist; it must not be sent.
                # Or the endpoint ended the transaction itself: parked, its outcome unknown
                unknown = outcome.kind is OutcomeKind.UNKNOWN
                if not unknown:  # rolled back: nothing of it exists, it may run again
                    self._settle(request)
                self._count(request.method, request.route, "unknown" if unknown else "failed")
                if captured.streaming:
                    raise StreamCutShort("the streamed response's transaction did not commit")
                await _send(request.send, *(_NOT_RECORDED if unknown else _NOT_COMMITTED))
                return
            self._settle(request)
            self._count(request.method, request.route, "executed")
        await self._respond(request, captured)

    async def _failed(self, request: _Request, outcome: Any) -> None:
        """A transactional attempt rolled back: settled, unless its outcome is unknown (the
        endpoint ended the transaction itself)."""
        if getattr(outcome, "kind", None) is not OutcomeKind.UNKNOWN:
            self._settle(request)

    async def _two_phase(self, request: _Request, recheck: bool) -> float | None:
        """One attempt, as :meth:`_transactional`."""
        if self._held_here(request, self._bypassed):
            return 1.0  # run unprotected by this process, in no record
        claim = TwoPhaseClaim(
            self.store,
            request.record_scope,
            request.key,
            request.fingerprint,
            lease=self.lease,
            notify=request.wait > 0,
        )
        try:
            decision = await claim.reserve()
        except StoreUnavailable as exc:
            if is_lock_timeout(exc):  # a concurrent owner holds the row: in flight
                return 1.0
            raise
        request.consulted = True
        if decision.kind is not DecisionKind.EXECUTE:
            return await self._decided(request, decision)
        assert claim.attempt is not None
        self._hold(request)
        context = IdempotencyContext(
            request.record_scope,
            request.key,
            "two_phase",
            downstream_key=claim.attempt.downstream_key,
        )
        try:
            captured = await self._run_app(request, context)
        except Retryable as exc:
            await claim.fail_retryable(exc)
            self._settle(request)  # not processed: it may run again
            log.info(
                "endpoint failed before its effect (retryable): %s",
                exc,
                extra={"scope": request.record_scope, "key": request.key},
            )
            self._count(request.method, request.route, "failed")
            if request.send.started:  # a stream that gave up: cut it short
                raise
            await _send(
                request.send,
                *problem(
                    503,
                    "retryable",
                    "Temporarily unavailable",
                    "the request was not processed; retry later",
                    [(b"retry-after", b"1")],
                ),
            )
            return None
        except BaseException as exc:  # the external call may have happened
            # a stream that died mid-way included: parked, never a stored success
            await claim.park(exc)
            raise
        if captured.incomplete:  # what the stream was doing when it stopped is unknown
            await claim.park(_StreamIncomplete())
            self._count(request.method, request.route, "unknown")
            return None
        if captured.status >= 500:  # it may have charged: parked, reconciled, never re-run
            await claim.park(_EndpointFailed(captured.status))
            self._count(request.method, request.route, "unknown")
        else:
            outcome = await claim.complete(response=self._stored(captured), writes=context.writes)
            if outcome.kind is not OutcomeKind.EXECUTED and not isinstance(
                outcome.error, LeaseLost
            ):
                # the effect happened, its record could not be written: parked as unknown
                self._count(request.method, request.route, "unknown")
                if captured.streaming:
                    raise StreamCutShort("the streamed response's outcome was not recorded")
                await _send(request.send, *_NOT_RECORDED)
                return None
            # executed; or fenced (the lease ran out, the record was parked): the effect
            # happened all the same, and the endpoint's answer says so
            if outcome.kind is OutcomeKind.EXECUTED:
                self._settle(request)
            self._count(request.method, request.route, "executed")
        await self._respond(request, captured)
        return None

    async def _respond(self, request: _Request, captured: _Captured) -> None:
        """Send the endpoint's answer, its outcome settled: the whole response, or the last
        message of a stream whose body went out as it came."""
        self._release(request)  # settled: a duplicate meets the record from here on
        if captured.final is not None:
            await request.send.raw(captured.final)
        else:
            await request.send.response(captured.status, captured.headers, bytes(captured.body))

    @tracing.traced("handler")
    async def _run_app(self, request: _Request, context: IdempotencyContext) -> _Captured:
        """Run the endpoint; its response is captured, not sent. A stream (more than one body
        chunk) is passed through as it comes, but its last message is held back: the client
        gets a complete response only once its outcome is committed (or, for a 5xx, rolled
        back or parked); when that fails, the response is cut short."""
        captured = _Captured()
        send = request.send
        inner = dict(request.scope)
        inner["state"] = {**(request.scope.get("state") or {}), "idempotency": context}
        extensions = request.scope.get("extensions")
        if extensions:
            # responses sent by reference (a file path) or with trailers would bypass the
            # capture: the app falls back to plain body messages, which are stored
            inner["extensions"] = {
                name: value for name, value in extensions.items() if name not in _BY_REFERENCE
            }

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured.status = message["status"]
                captured.headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                if captured.streaming:
                    if more:
                        await send.raw(message)
                    else:
                        captured.final = message
                elif more:
                    captured.streaming = True
                    headers = captured.headers
                    if captured.status < 500:  # a 5xx is never stored
                        headers = [*headers, (b"idempotency-stored", b"headers-only")]
                    await send.raw(
                        {
                            "type": "http.response.start",
                            "status": captured.status,
                            "headers": headers,
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

        request.ran = True
        await self.app(inner, request.receive, capture)
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

    async def _decided(self, request: _Request, decision: Decision) -> float | None:
        """Someone else's key: answer, or (in flight) say when to look again."""
        request.consulted = True
        if decision.kind is DecisionKind.IN_PROGRESS:
            return decision.retry_after
        await self._answer(request, decision)
        return None

    async def _answer(self, request: _Request, decision: Decision) -> None:
        send = request.send
        record = decision.record
        if decision.kind is DecisionKind.REPLAY:
            self._count(request.method, request.route, "replayed")
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
            self._count(request.method, request.route, "key_misuse")
            await _send(
                send,
                *problem(
                    422,
                    "idempotency-key-reused",
                    "Idempotency-Key reused with another request",
                    "this key was used with a different method, path, query or body",
                ),
            )
        else:  # UNKNOWN
            self._count(request.method, request.route, "unknown")
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
        if message["type"] == "http.response.start":
            tracing.http_status(message["status"])
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
    """The whole request body. A disconnect before its last chunk is no end of body: the
    request is incomplete (raises :class:`_ClientGone`), and nothing may run on a part of it."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
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
