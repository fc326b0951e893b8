"""Handlers and resolvers the CLI tests load by ``module:function``, as an operator would.

The scope comes from ``CLI_TEST_SCOPE`` (each test has its own); ``CLI_TEST_FIXED=1`` is the
deploy that fixes the handler's bug.
"""

from __future__ import annotations

import os
from typing import Any

import asyncpg

from consumer_idem import (
    ConsumerMessage,
    Executed,
    IdempotentConsumer,
    NotExecuted,
    PostgresStore,
    header,
    idempotent_consumer,
)
from consumer_idem.operations.reconcile import Answer, StillUnknown
from consumer_idem.types import Record


def buggy_consumer(store: PostgresStore) -> IdempotentConsumer:
    """Transactional; a body ``{"fail": true}`` raises until the fix is deployed."""

    async def handle(message: ConsumerMessage, conn: asyncpg.Connection) -> Any:
        body = message.json()
        if body.get("fail") and os.environ.get("CLI_TEST_FIXED") != "1":
            raise RuntimeError("handler bug: cannot book this payment")
        return {"booked": body.get("id")}

    return idempotent_consumer(
        store, scope=os.environ["CLI_TEST_SCOPE"], key=header("idempotency-key")
    )(handle)


async def by_key_prefix(record: Record) -> Answer:
    """``exec-*`` did happen, ``not-*`` did not, anything else cannot be told yet."""
    if record.key.startswith("exec-"):
        return Executed({"resolved_by": "cli-test"})
    if record.key.startswith("not-"):
        return NotExecuted("no charge at the gateway")
    return StillUnknown("gateway still processing")
