"""What an endpoint sees of its idempotency: ``request.state.idempotency`` and its helpers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from starlette.requests import HTTPConnection

from consumer_idem.errors import NotInTransaction
from consumer_idem.http.routing import Mode
from consumer_idem.outbox import UnitOutbox, outbox_for


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
    #: did the endpoint begin executing? ``None``: this request cannot tell (its response is
    #: recorded); ``False`` until it begins: a response before then is passed through
    began: bool | None = None

    def add_write(self, write: Callable[[asyncpg.Connection], Awaitable[Any]]) -> None:
        """Two-phase mode: a local write committed together with the stored response."""
        self.writes.append(write)


def idempotency_of(conn: HTTPConnection) -> IdempotencyContext | None:
    """The request's [`IdempotencyContext`][consumer_idem.http.context.IdempotencyContext]
    (``request.state.idempotency``), typed;
    ``None`` when the middleware does not protect this request."""
    context = conn.scope.get("state", {}).get("idempotency")
    return context if isinstance(context, IdempotencyContext) else None


def transaction_of(conn: HTTPConnection) -> asyncpg.Connection:
    """The connection of the request's idempotency transaction (transactional routes): write
    here to commit with the stored response. Raises
    [`NotInTransaction`][consumer_idem.NotInTransaction] otherwise."""
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
    (``outbox: UnitOutbox = Depends(outbox_of)``). Raises
    [`NotInTransaction`][consumer_idem.NotInTransaction] where
    [`transaction_of`][consumer_idem.http.context.transaction_of] does. Attach a sender for it at
    startup
    (``consumer_idem.outbox.OutboxService``)."""
    return outbox_for(transaction_of(conn))
