"""Which requests take part: per-route options (``@idempotent`` / ``@not_idempotent``) and the
route a request goes to, resolved the way Starlette's router resolves it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.datastructures import Headers
from starlette.routing import Host, Match, Mount

from consumer_idem.errors import ConfigurationError
from consumer_idem.http.asgi import Scope
from consumer_idem.http.hooks import RequestHook

Mode = Literal["transactional", "two_phase"]


@dataclass(frozen=True)
class RouteOptions:
    enabled: bool = True
    required: bool | None = None
    mode: Mode | None = None
    fail_open: bool | None = None
    wait: float | None = None
    anonymous: bool | None = None
    on_execute: RequestHook | None = None
    on_replay: RequestHook | None = None


def idempotent(
    *,
    required: bool | None = None,
    mode: Mode | None = None,
    fail_open: bool | None = None,
    wait: float | None = None,
    anonymous: bool | None = None,
    on_execute: RequestHook | None = None,
    on_replay: RequestHook | None = None,
) -> Callable[[Any], Any]:
    """Per-route options (``None`` keeps the middleware's default). ``wait``: seconds a
    duplicate that meets this route's first request in flight waits for its result (then
    replays it) before answering 409. ``anonymous``: whether a request whose ``caller=``
    names nobody (and that has no authenticated principal) may take part, in the one
    ``anonymous`` key space all such requests share (default: the middleware's
    ``shared_keys``); refused with a 401 otherwise. ``on_execute`` / ``on_replay``: this
    route's hooks (`consumer_idem.http.hooks`), instead of the middleware's."""
    if wait is not None and wait < 0:
        raise ConfigurationError("wait is a number of seconds, 0 or more")

    def mark(endpoint: Any) -> Any:
        endpoint.__consumer_idem__ = RouteOptions(
            True, required, mode, fail_open, wait, anonymous, on_execute, on_replay
        )
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
    #: the route as declared, when the request goes to an endpoint route (not a mount)
    route: Any = None


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
    """[`resolve_route`][consumer_idem.http.routing.resolve_route], with the concrete hosts routing
    depended on."""
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
            prefix + str(getattr(route, "path", "")),
            _options(endpoint, inherited),
            hosts,
            declared,
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
