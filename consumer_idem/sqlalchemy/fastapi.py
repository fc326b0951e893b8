"""FastAPI: the bound session of the current idempotent request, through ``Depends``::

    from consumer_idem.sqlalchemy.fastapi import IdempotentSession

    @app.post("/orders", status_code=201)
    @idempotent(required=True)
    async def create(order: OrderIn, session: IdempotentSession) -> OrderOut:
        row = Order(sku=order.sku, qty=order.qty)
        session.add(row)
        await session.flush()                  # the id; commits with the stored response
        return OrderOut.model_validate(row, from_attributes=True)

The route must be transactional and its requests must carry an ``Idempotency-Key`` (make it
``required``): a request without one has no transaction to bind to and fails with
[`NotInTransaction`][consumer_idem.http.NotInTransaction].
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import asyncpg
from fastapi import Depends
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.requests import Request

from consumer_idem.http import transaction_of
from consumer_idem.sqlalchemy import request_session

__all__ = ["IdempotentSession", "IdempotentTransaction", "idempotent_session"]


async def idempotent_session(request: Request) -> AsyncIterator[AsyncSession]:
    """The dependency: a session bound to the request's idempotency transaction, flushed when
    the endpoint is done (the middleware commits it with the stored response)."""
    async with request_session(request) as session:
        yield session


def idempotent_transaction(request: Request) -> asyncpg.Connection:
    """The dependency: the request's idempotency transaction's asyncpg connection."""
    return transaction_of(request)


#: ``session: IdempotentSession`` in an endpoint of a transactional idempotent route
IdempotentSession = Annotated[AsyncSession, Depends(idempotent_session)]
#: ``conn: IdempotentTransaction``: the raw connection of the same transaction, never ``None``
IdempotentTransaction = Annotated[asyncpg.Connection, Depends(idempotent_transaction)]
