"""Did the endpoint begin executing? The one place that reaches into FastAPI and Starlette
for it: neither offers a public hook that runs once a request passed routing, validation and
dependencies and the endpoint is called. Checked with FastAPI 0.165.0 and Starlette 1.10.0.

What stands in for that hook:

- a FastAPI ``APIRoute``: its ``dependant.call`` (the endpoint function) is wrapped. FastAPI
  calls it only after the body and parameters validated and every dependency returned; its
  handler reads ``dependant.call`` on each request.
- a plain Starlette ``Route``: its ``app`` is wrapped. ``Route.handle`` calls it once the
  method is allowed (a 405 is answered before); it is the endpoint itself.

Only the routes of the router itself are marked. A request that goes elsewhere (a ``Mount``,
a ``Host``, an included FastAPI router, a route of another class) is not watched, and its
response is recorded whatever it is, as before this rule existed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from starlette.routing import Route, WebSocketRoute

from consumer_idem.http.asgi import Receive, Scope, Send
from consumer_idem.http.context import IdempotencyContext

#: the idempotency context of the request being handled, for the markers to find
running: ContextVar[IdempotencyContext | None] = ContextVar("consumer_idem_http", default=None)

_MARKED = "__consumer_idem_began__"

#: the route of a request no route matched (the router answers 404 or 405 itself)
NOWHERE = object()


def began() -> None:
    """The endpoint of the request being handled begins executing: its response counts."""
    context = running.get()
    if context is not None:
        context.began = True


def _marked_call(call: Callable[..., Any]) -> Callable[..., Any]:
    # a plain function whatever ``call`` is: FastAPI decided at start-up whether to await
    # what it returns or to run it in a thread, and either still holds
    @functools.wraps(call)
    def endpoint(*args: Any, **kwargs: Any) -> Any:
        began()
        return call(*args, **kwargs)

    return endpoint


def _marked_app(app: Callable[..., Any]) -> Callable[..., Any]:
    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        began()
        await app(scope, receive, send)

    return endpoint


def _mark(route: Any) -> bool:
    """Mark ``route`` (once): can it tell when its endpoint begins?"""
    if getattr(route, _MARKED, False):
        return True
    dependant = getattr(route, "dependant", None)
    if dependant is not None and callable(getattr(dependant, "call", None)):
        dependant.call = _marked_call(dependant.call)  # a FastAPI APIRoute
    elif type(route) is Route:
        route.app = _marked_app(route.app)
    else:
        return False
    setattr(route, _MARKED, True)
    return True


def watched(router: Any, declared: Any) -> bool:
    """Mark the routes of ``router`` (those added since too); does a request that goes to
    ``declared`` (`NOWHERE`: the router answers 404 or 405 itself; ``None``: a mount)
    tell when its endpoint begins?"""
    routes = getattr(getattr(router, "router", router), "routes", None) or ()
    everywhere = True
    for route in routes:
        if not _mark(route) and not isinstance(route, WebSocketRoute):
            everywhere = False
    if declared is NOWHERE:  # every route would say so, had it been reached after all
        return everywhere
    return any(route is declared for route in routes) and getattr(declared, _MARKED, False)
