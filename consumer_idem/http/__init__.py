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
raw bytes; JSON nested past `MAX_DEPTH` is raw bytes too).
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
  may opt into fail-open: see `may_bypass` for the narrow case);
* 503 ``outcome-unknown``: the endpoint ran, but its outcome could not be recorded (a
  two-phase completion failed, or the store failed after the endpoint ran): never "not
  processed", and the retry never applies it twice.

Routes opt in or out with ``@idempotent(...)`` / ``@not_idempotent`` on the endpoint. Two modes,
both driven by the claim engine (`consumer_idem.claim`):

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

The package, one module per concept: `routing` (which requests take
part), `key_header` and `reading` (the key,
the body, the fingerprint), `callers` (whose key it is),
`admission` (a request taken in, or answered),
`keyed_request` (one request from its claim to its response),
`capture` (the endpoint's response, held until it is stored),
`responses` (problem+json, replays),
`fail_open` (when a route may run unprotected),
`context` (what the endpoint sees) and
`middleware`.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import starlette  # noqa: F401 - the http extra
except ImportError as exc:
    raise missing("http", exc, __name__) from exc

# Importable from here since before the package: the errors it raises, the downstream key
from consumer_idem.downstream import downstream_key_for as downstream_key_for
from consumer_idem.errors import CommitRolledBack as CommitRolledBack
from consumer_idem.errors import ConfigurationError as ConfigurationError
from consumer_idem.errors import InvalidKey as InvalidKey
from consumer_idem.errors import KeyHeaderError as KeyHeaderError
from consumer_idem.errors import KeyInFlight as KeyInFlight
from consumer_idem.errors import LeaseLost as LeaseLost
from consumer_idem.errors import NotInTransaction as NotInTransaction
from consumer_idem.errors import Retryable as Retryable
from consumer_idem.errors import SchemaMissing as SchemaMissing
from consumer_idem.errors import StoreRejected as StoreRejected
from consumer_idem.errors import StoreUnavailable as StoreUnavailable
from consumer_idem.errors import StreamCutShort as StreamCutShort
from consumer_idem.http.asgi import ASGIApp, Message, Receive, Scope, Send
from consumer_idem.http.callers import ANONYMOUS, Caller, principal
from consumer_idem.http.context import (
    IdempotencyContext,
    idempotency_of,
    outbox_of,
    transaction_of,
)
from consumer_idem.http.fail_open import (
    UNSETTLED_MAX,
    UNSETTLED_MIN_TTL,
    outage_proven,
)
from consumer_idem.http.hooks import RequestHook, RequestOutcome
from consumer_idem.http.key_header import HEADER, parse_key_header
from consumer_idem.http.keyed_request import RECHECK_LOCK_TIMEOUT_MS
from consumer_idem.http.middleware import IdempotencyMiddleware
from consumer_idem.http.reading import request_fingerprint
from consumer_idem.http.responses import PROBLEM_TYPE, problem
from consumer_idem.http.routing import (
    Mode,
    Routed,
    RouteOptions,
    find_router,
    idempotent,
    not_idempotent,
    resolve_route,
    route_of,
)
from consumer_idem.outbox import UnitOutbox as UnitOutbox

#: the HTTP integration's own names (the reference documents these)
__all__ = [
    "ANONYMOUS",
    "HEADER",
    "PROBLEM_TYPE",
    "RECHECK_LOCK_TIMEOUT_MS",
    "UNSETTLED_MAX",
    "UNSETTLED_MIN_TTL",
    "ASGIApp",
    "Caller",
    "IdempotencyContext",
    "IdempotencyMiddleware",
    "Message",
    "Mode",
    "Receive",
    "RequestHook",
    "RequestOutcome",
    "RouteOptions",
    "Routed",
    "Scope",
    "Send",
    "find_router",
    "idempotency_of",
    "idempotent",
    "not_idempotent",
    "outage_proven",
    "outbox_of",
    "parse_key_header",
    "principal",
    "problem",
    "request_fingerprint",
    "resolve_route",
    "route_of",
    "transaction_of",
]
