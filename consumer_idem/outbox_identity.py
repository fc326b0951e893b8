"""Who an outgoing message of the outbox is: the run of its unit, and the route it takes.

A *run* is one execution of a unit (one incoming ``scope``/``key``) that may commit: the claim
draws a random id for it when it takes the key. A key runs once while its record lives; once
the record is gone (pruned after the retention, or evicted by an operator) the same key is new
work, and its next run's messages are new messages. So the ``idempotency-key`` of a message
hashes the run with the unit and the position
([`outgoing_key`][consumer_idem.outbox_identity.outgoing_key]), and is stored with the
row: every copy of one row (a dispatch, a relay's retries) carries the same key, and a later
run's messages carry others.

A *route* is the transport and broker a sender sends to, as the sender states it (its ``route``
attribute: ``kafka:<bootstrap servers>``, ``amqp:<host:port>[/<vhost>]``). A row records the route
of the sender serving its unit's scope when the unit ran, and a relay claims only rows of its
own sender's route ([`route_of`][consumer_idem.outbox_identity.route_of]), so a message is never
sent through another transport or
to another cluster than the one it was published for.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["amqp_where", "broker_route", "kafka_where", "new_run", "outgoing_key", "route_of"]


def new_run() -> str:
    """A fresh run id: one per execution of a unit."""
    return str(uuid.uuid4())


def outgoing_key(scope: str, key: str, position: int, run: str | None = None) -> str:
    """The ``idempotency-key`` of the message at ``position`` (0, 1, ...) of the run ``run``
    of the unit (``scope``, ``key``): the same on every copy of the message, another for each
    run. (Without ``run``: the key of a row written before runs were recorded.)"""
    parts = [scope, key, str(position)] if run is None else [scope, key, run, str(position)]
    digest = hashlib.sha256("\x00".join(["outbox", *parts]).encode()).hexdigest()
    return f"ci-{digest[:40]}"


def route_of(sender: Any) -> str | None:
    """The route ``sender`` states (None: it states none; its rows are routed nowhere and only a
    relay naming their scopes sends them)."""
    route = getattr(sender, "route", None)
    if route is not None and (not isinstance(route, str) or not route):
        raise TypeError(f"a sender's route must be a non-empty string, not {route!r}")
    return route


def broker_route(transport: str, where: str | None) -> str:
    """``transport`` (``kafka``, ``amqp``) and, when known, the broker or cluster it reaches."""
    return transport if not where else f"{transport}:{where}"


def kafka_where(servers: str | Sequence[str] | None) -> str | None:
    """The cluster a Kafka bootstrap list names, spelled one way whatever the order or the form
    of the list (``"b:9092,a:9092"``, ``["a:9092", "b:9092"]``): its servers, sorted (None:
    none). A name of yours that is no list stays as it is."""
    items = [servers] if isinstance(servers, str) else list(servers or [])
    named = {s.strip() for item in items for s in item.split(",") if s.strip()}
    return ",".join(sorted(named)) or None


def amqp_where(url: str | None) -> str | None:
    """``host:port`` and, unless it is the default ``/``, ``/vhost`` of an AMQP URL (no
    credentials); a name that is no URL, as it is."""
    if not url or "://" not in url:
        return url or None
    parsed = urlsplit(url)
    vhost = unquote(parsed.path[1:])
    where = f"{parsed.hostname}:{parsed.port or 5672}"
    return where if vhost in ("", "/") else f"{where}/{vhost}"
