"""What a handler can inject, and the delivery call in progress (a context variable)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any

import asyncpg
from faststream import Context, StreamMessage

from consumer_idem.consumer import (
    Verdict,
)
from consumer_idem.execution import Attempt
from consumer_idem.faststream import batch
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.message import ConsumerMessage
from consumer_idem.outbox import (
    UnitOutbox,
)

log = logging.getLogger("consumer_idem.faststream")


DEFAULT_RECONCILE_DESTINATION = "consumer_idem.reconcile"
#: the context name under which the handler finds :class:`IdempotencyContext`
CONTEXT_NAME = "idempotency"


@dataclass(frozen=True, slots=True)
class IdempotencyContext:
    """What an idempotent handler can inject (``Context("idempotency")``)."""

    scope: str
    key: str
    #: the transport-neutral view of the raw delivery (headers as bytes, coordinates)
    message: ConsumerMessage
    #: transactional mode: the open connection; write on it to commit with the record
    conn: asyncpg.Connection | None = None
    #: two-phase mode: the attempt (``attempt.downstream_key`` for the far side)
    attempt: Attempt | None = None
    #: transactional mode: the unit's outbox (what is published there commits with it)
    outbox: UnitOutbox | None = None


#: the open transaction's connection, for a handler parameter: ``conn: IdempotentConnection``
IdempotentConnection = Annotated[asyncpg.Connection, Context(f"{CONTEXT_NAME}.conn")]
#: the two-phase attempt, for a handler parameter: ``attempt: IdempotentAttempt``
IdempotentAttempt = Annotated[Attempt, Context(f"{CONTEXT_NAME}.attempt")]
#: the unit's outbox (transactional mode), for a handler parameter: ``outbox: IdempotentOutbox``;
#: its messages go out through the broker right after the commit
IdempotentOutbox = Annotated[UnitOutbox, Context(f"{CONTEXT_NAME}.outbox")]
#: scope, key, raw message and connection or attempt together
CurrentIdempotency = Annotated[IdempotencyContext, Context(CONTEXT_NAME)]


class _Settled(Exception):
    """Raised from the handler call so that FastStream publishes nothing for this delivery
    (dead letter, retry, unknown, domain error, any batch); the middleware swallows it after
    settling."""

    def __init__(self, verdict: Verdict | None) -> None:
        what = "batch" if verdict is None else f"{verdict.action} ({verdict.reason})"
        super().__init__(f"consumer-idem: {what}")
        self.verdict = verdict


@dataclass(frozen=True, slots=True)
class _Call:
    call_next: Callable[[StreamMessage[Any]], Awaitable[Any]]
    message: StreamMessage[Any]
    context: Any
    key: str
    #: a batch: the handler's copy of the whole delivery, decoded while its claim was in flight
    ahead: batch.DecodedAhead | None = None


_CURRENT: ContextVar[_Call] = ContextVar("consumer_idem_faststream_call")
