"""FastStream: the bound session of the current idempotent delivery, through FastStream's own
dependency injection::

    from consumer_idem.sqlalchemy.faststream import IdempotentSession

    @router.subscriber("orders", group_id="orders", ack_policy=AckPolicy.MANUAL)
    async def handle(body: dict, session: IdempotentSession) -> dict:
        session.add(Order(sku=body["sku"], qty=body["qty"]))
        return {"ok": True}                    # flushed, then committed with the record

The subscriber's router (or broker) carries [`Idempotency`][consumer_idem.faststream.Idempotency] in
transactional mode. A session that rolled back fails the delivery
([`SessionRolledBack`][consumer_idem.sqlalchemy.SessionRolledBack]): nothing of it commits, it runs
again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from faststream import Depends
from sqlalchemy.ext.asyncio import AsyncSession

from consumer_idem.errors import ConfigurationError
from consumer_idem.faststream import CurrentIdempotency
from consumer_idem.sqlalchemy import SessionRolledBack, bound_session, rolled_back

__all__ = ["IdempotentSession", "idempotent_session"]


async def idempotent_session(current: CurrentIdempotency) -> AsyncIterator[AsyncSession]:
    """The dependency: a session bound to the delivery's idempotency transaction."""
    if current.conn is None:
        raise ConfigurationError(
            "IdempotentSession needs a transactional Idempotency middleware (two-phase "
            "handlers have no transaction to write in)"
        )
    async with bound_session(current.conn) as session:
        yield session
    if rolled_back(session):
        raise SessionRolledBack(
            "the handler's session rolled back: the whole idempotent unit was rolled back"
        )


#: ``session: IdempotentSession`` in a handler behind a transactional ``Idempotency``
IdempotentSession = Annotated[AsyncSession, Depends(idempotent_session)]
