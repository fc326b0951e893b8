"""Admission: which requests the middleware takes in, and the problem it answers for one it
cannot (no key where the route needs one, a malformed key, a body too large, an unknown
caller). An admitted request has its route, its key, its whole body and its record scope."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from consumer_idem.errors import InvalidKey, KeyHeaderError
from consumer_idem.http import responses
from consumer_idem.http._compat import NOWHERE, watched
from consumer_idem.http.asgi import Receive, Scope, Send
from consumer_idem.http.callers import ANONYMOUS
from consumer_idem.http.key_header import HEADER, parse_key_header
from consumer_idem.http.keyed_request import KeyedRequest
from consumer_idem.http.reading import ClientGone, TooLarge, read_body, request_fingerprint
from consumer_idem.http.responses import send_response
from consumer_idem.http.routing import Routed, RouteOptions, route_of

if TYPE_CHECKING:
    from consumer_idem.http.middleware import IdempotencyMiddleware

log = logging.getLogger("consumer_idem.http")


class CallerUnknown(Exception):
    """``caller(conn)`` raised: the request does not say whose it is."""


class CallerMissing(Exception):
    """``caller(conn)`` named nobody (and no principal is authenticated), on a route that
    takes no anonymous requests: ``caller=`` is there to keep callers apart."""


def routed(router: object, scope: Scope) -> Routed:
    """The route ``scope`` goes to. With no route at this scope (a middleware further in may
    rewrite the path), a keyed request is never let through unprotected: its template is the
    path as it came."""
    found = route_of(router, scope)
    if found is not None:
        return found
    raw_path = scope.get("raw_path")
    path = raw_path.decode("latin-1") if raw_path else scope["path"]
    return Routed(path.split("?", 1)[0], RouteOptions(), route=NOWHERE)


async def admit(
    middleware: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send
) -> KeyedRequest | None:
    """The request to handle with its key; ``None`` when it was passed on to the app (its
    route takes no part, or it has no key and needs none) or answered here."""
    route = routed(middleware.router, scope)
    options = route.options
    if not options.enabled:
        await middleware.app(scope, receive, send)
        return None
    method = scope["method"]
    raw = [v for k, v in scope["headers"] if k == HEADER]
    if not raw:
        required = middleware.required if options.required is None else options.required
        if not required:
            await middleware.app(scope, receive, send)
            return None
        middleware.count(method, route.template, "missing_key")
        await send_response(send, responses.key_missing(method, route.template))
        return None
    try:
        return await _read(middleware, route, raw, scope, receive, send)
    except (KeyHeaderError, InvalidKey, TooLarge, CallerUnknown, CallerMissing, ClientGone) as exc:
        await _refuse(middleware, method, route.template, exc, send)
        return None


async def _read(
    middleware: IdempotencyMiddleware,
    route: Routed,
    raw: list[bytes],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> KeyedRequest:
    """The key, the whole body and the caller of the request: the record it belongs to."""
    if len(raw) > 1:  # which one would the client mean? neither is safe to guess
        raise KeyHeaderError("send one Idempotency-Key header, not several")
    key = parse_key_header(raw[0].decode("latin-1"))
    body = await read_body(receive, middleware.max_body)
    try:
        caller = middleware.caller_of(scope, route.hosts)
    except Exception as exc:
        raise CallerUnknown from exc
    options = route.options
    if _refuses_anonymous(middleware, options) and caller.split("|", 1)[0] == ANONYMOUS:
        raise CallerMissing
    method = scope["method"]
    record_scope, key = middleware.store.check(f"http:{caller}:{method} {route.template}", key)
    return KeyedRequest(
        middleware=middleware,
        scope=scope,
        body=body,
        server_receive=receive,
        server_send=send,
        method=method,
        route=route.template,
        record_scope=record_scope,
        key=key,
        fingerprint=request_fingerprint(
            method,
            scope["path"],
            scope.get("query_string", b""),
            body,
            host="|".join(route.hosts) or None,
        ),
        mode=options.mode or middleware.mode,
        fail_open=middleware.fail_open if options.fail_open is None else options.fail_open,
        wait=middleware.wait if options.wait is None else options.wait,
        started_at=time.monotonic(),
        watched=watched(middleware.router, route.route),
        on_execute=options.on_execute or middleware.on_execute,
        on_replay=options.on_replay or middleware.on_replay,
    )


def _refuses_anonymous(middleware: IdempotencyMiddleware, options: RouteOptions) -> bool:
    """Is a request whose ``caller=`` names nobody refused (401) on this route? Unless the
    route (``@idempotent(anonymous=True)``) or the middleware (``shared_keys=True``) takes
    anonymous requests, which then share one key space. Without ``caller=``, requests with
    no principal are anonymous by the middleware's set-up (``shared_keys=True``)."""
    if middleware.caller is None:
        return False
    return not (middleware.shared_keys if options.anonymous is None else options.anonymous)


async def _refuse(
    middleware: IdempotencyMiddleware, method: str, route: str, exc: Exception, send: Send
) -> None:
    """Answer a request that cannot be admitted (or, its client gone, nobody)."""
    if isinstance(exc, KeyHeaderError | InvalidKey):
        middleware.count(method, route, "invalid_key")
        await send_response(send, responses.key_invalid(str(exc)))
    elif isinstance(exc, TooLarge):
        await send_response(send, responses.body_too_large(middleware.max_body))
    elif isinstance(exc, CallerMissing):
        middleware.count(method, route, "caller_missing")
        await send_response(send, responses.CALLER_MISSING)
    elif isinstance(exc, CallerUnknown):
        # the caller function failed (a header it reads is missing): whose key this is
        # cannot be told, so it takes no part; the cause goes to the log only
        middleware.count(method, route, "caller_unknown")
        log.warning("caller= failed for %s %s", method, route, exc_info=exc.__cause__)
        await send_response(send, responses.CALLER_UNKNOWN)
    else:
        # the body is incomplete: nothing may run on it and nothing is claimed; the client
        # is gone, so there is nobody to answer (its retry runs as a first request)
        middleware.count(method, route, "client_disconnected")
        log.info("client disconnected before the request body was complete")
