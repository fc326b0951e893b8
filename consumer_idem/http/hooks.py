"""``on_execute`` / ``on_replay`` of HTTP routes: called with a
[`RequestOutcome`][consumer_idem.http.hooks.RequestOutcome] when an endpoint ran and its
response was recorded, or when a duplicate is answered from the record: for metrics, and for
headers on the response about to be sent (``outcome.set_header(...)``).

A hook runs synchronously, just before the response is sent, so it must not block. What it
raises is logged and dropped: the outcome is committed, a failing counter must not turn it
into an error response. Headers it sets are not recorded: a replay's hook sets its own. On a
streamed response they count only if set before the stream began (the first run's headers
are sent with its first chunk)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestHook", "RequestOutcome", "call_request_hook"]

log = logging.getLogger("consumer_idem.hooks")


@dataclass
class RequestOutcome:
    """One keyed request whose endpoint ran (``replayed`` False) or that was answered from
    its record (``replayed`` True)."""

    #: the record's scope (``http:<caller>:<METHOD> <route>``) and the request's key
    scope: str
    key: str
    method: str
    #: the route's template, ``/orders/{id}``
    route: str
    replayed: bool
    #: the response's status, and its headers as ASGI sends them (latin-1 bytes)
    status: int
    headers: list[tuple[bytes, bytes]]
    #: the request's ASGI scope
    request: Any

    def set_header(self, name: str, value: str) -> None:
        """Set a header of the response about to be sent (replacing one of that name)."""
        raw = name.lower().encode("latin-1")
        self.headers[:] = [(k, v) for k, v in self.headers if k.lower() != raw]
        self.headers.append((raw, value.encode("latin-1")))


#: ``callback(outcome)``; its return value is ignored
RequestHook = Callable[[RequestOutcome], object]


def call_request_hook(hook: RequestHook | None, outcome: RequestOutcome) -> None:
    """``hook(outcome)``, with a failure logged instead of raised."""
    if hook is None:
        return
    try:
        hook(outcome)
    except Exception:
        log.exception(
            "scope=%s key=%s: a request hook failed (%r)",
            outcome.scope,
            outcome.key,
            hook,
            extra={"scope": outcome.scope, "key": outcome.key},
        )
