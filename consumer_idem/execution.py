"""The two execution modes: how a unit of work runs around a reservation.

* [`run_transactional`][consumer_idem.execution.run_transactional] — the effect lives in the same
Postgres: claim, handler, completion
  and COMMIT are one transaction. A crash anywhere before COMMIT leaves neither row nor effect.
* [`run_two_phase`][consumer_idem.execution.run_two_phase] — the effect is external I/O: the claim
commits with a lease, the I/O
  runs outside any transaction, and the completion commits in a second transaction. Failures are
  classified ([`Retryable`][consumer_idem.execution.Retryable],
  [`Ambiguous`][consumer_idem.Ambiguous], [`DomainError`][consumer_idem.execution.DomainError]);
  anything else is
  ambiguous, because the I/O may already have started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg

from consumer_idem.claim import (
    Attempt,
    TransactionalClaim,
    TwoPhaseClaim,
    outcome_of,
)
from consumer_idem.commit import Rider
from consumer_idem.errors import DomainError, PoisonMessage, Retryable
from consumer_idem.result_types import result_type_of
from consumer_idem.stores.base import Store
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.stores.results import encode_result
from consumer_idem.types import DecisionKind, Outcome, ResultKind

__all__ = [
    "Attempt",
    "LocalWrites",
    "TransactionalHandler",
    "TwoPhaseAction",
    "outcome_of",
    "run_transactional",
    "run_two_phase",
]

log = logging.getLogger("consumer_idem.execution")


TransactionalHandler = Callable[[asyncpg.Connection], Awaitable[Any]]


TwoPhaseAction = Callable[[Attempt], Awaitable[Any]]
LocalWrites = Callable[[asyncpg.Connection, Any], Awaitable[None]]


async def run_transactional(
    store: PostgresStore,
    scope: str,
    key: str | bytes,
    fingerprint: str,
    handler: TransactionalHandler,
    *,
    retention: timedelta | float | None = None,
    conn: asyncpg.Connection | None = None,
    rider: Rider | None = None,
    result_type: Any = None,
) -> Outcome:
    """Claim, run ``handler(conn)`` and complete in one transaction, then commit.

    The handler gets the open connection and must do its database writes on it. Its return
    value (JSON-serialisable) is stored as the result. A concurrent duplicate blocks on the
    unique index until this commits, then replays. If the handler raises, everything rolls back:
    [`DomainError`][consumer_idem.execution.DomainError] is stored as a completed domain-error
    result, [`Ambiguous`][consumer_idem.Ambiguous] parks
    the key as ``unknown``, anything else is ``failed_retryable`` (nothing was committed). So is
    a COMMIT PostgreSQL did not carry out (the handler caught a database error without a
    savepoint and returned: COMMIT answers ``ROLLBACK``): never ``executed``, never cached. The
    sequence is `TransactionalClaim`, shared with HTTP.

    A new key costs three round trips, like the handler's write alone (BEGIN+claim, the
    handler's statements, result+COMMIT); a key that already has a row goes through
    [`PostgresStore.reserve`][consumer_idem.PostgresStore.reserve] inside the same transaction. Pass
    ``conn`` (not in a
    transaction) to run on a connection you hold, e.g. one per consumer worker, instead of a
    pooled one. ``rider``: a statement of yours committed with the completion, in the same
    round trip (see `Rider`). ``result_type``: the type a replayed result is read back as
    (see `consumer_idem.result_types`; ``None``: the decoded JSON).
    """
    scope, key = store.check(scope, key)
    cached = await store.cached_decision(scope, key, fingerprint)
    if cached is not None:  # a duplicate of completed work: no Postgres round trip at all
        return _typed(outcome_of(cached), result_type)
    async with (
        store.connection(conn) as conn,
        TransactionalClaim(
            store, conn, scope, key, fingerprint, retention=retention, rider=rider
        ) as claim,
    ):
        if claim.decision is not None:
            return _typed(outcome_of(claim.decision), result_type)
        try:
            result = await handler(conn)
            encoded = encode_result(result)  # an unstorable result is a handler failure
        except (Exception, asyncio.CancelledError) as exc:
            return _typed(await claim.fail(exc), result_type)
        return _typed(await claim.complete(result, encoded=encoded), result_type)


async def run_two_phase(
    store: Store,
    scope: str,
    key: str | bytes,
    fingerprint: str,
    action: TwoPhaseAction,
    *,
    local_writes: LocalWrites | None = None,
    lease: timedelta | float | None = None,
    retention: timedelta | float | None = None,
    result_type: Any = None,
) -> Outcome:
    """Claim with a lease, run ``action(attempt)`` outside any transaction, then complete.

    ``local_writes(conn, result)``, if given, runs in the completion's transaction, so local rows
    commit with the completion. Outcomes by exception:
    [`Retryable`][consumer_idem.execution.Retryable] -> ``failed_retryable``;
    [`DomainError`][consumer_idem.execution.DomainError] -> ``completed`` with the error result;
    [`PoisonMessage`][consumer_idem.execution.PoisonMessage] (raise
    it before the external call) -> the key as it was, the delivery dead-lettered;
    [`Ambiguous`][consumer_idem.Ambiguous] or any other
    exception (the I/O may have started, including a builtin ``TimeoutError`` or
    ``ConnectionError``) -> ``unknown``. Cancellation also parks as ``unknown``. A completion
    that cannot be written after the action succeeded (local writes failed, the commit rolled
    back) parks as ``unknown`` too: the external effect happened, its local record did not.

    Whenever a write of this attempt finds its lease gone (the lease expired and the record was
    parked, resolved or evicted), the outcome is what the record says now; this attempt reports
    nothing of its own. The sequence is `TwoPhaseClaim`, shared
    with HTTP. ``result_type``: the type a replayed result is read back as (see
    `consumer_idem.result_types`; ``None``: the decoded JSON).
    """
    scope, key = store.check(scope, key)
    claim = TwoPhaseClaim(store, scope, key, fingerprint, lease=lease, retention=retention)
    decision = await claim.reserve()
    if decision.kind is not DecisionKind.EXECUTE:
        return _typed(outcome_of(decision), result_type)
    assert claim.attempt is not None
    try:
        result = await action(claim.attempt)
    except Retryable as exc:
        return _typed(await claim.fail_retryable(exc), result_type)
    except PoisonMessage as exc:  # refused before any external call: dead-lettered, not parked
        return _typed(await claim.poison(exc), result_type)
    except DomainError as exc:
        return _typed(
            await claim.complete(exc.result, result_kind=ResultKind.DOMAIN_ERROR), result_type
        )
    except (Exception, asyncio.CancelledError) as exc:
        # Ambiguous, or unclassified: the external call may have happened. Park, never re-run.
        return _typed(await claim.park(exc), result_type)
    if local_writes is None:
        return _typed(await claim.complete(result), result_type)

    async def write(conn: asyncpg.Connection) -> None:
        await local_writes(conn, result)

    return _typed(await claim.complete(result, writes=[write]), result_type)


def _typed(outcome: Outcome, result_type: Any) -> Outcome:
    """``outcome`` with a replayed result read back as ``result_type`` (inline in the runners,
    not a wrapper: the handler runs no frame deeper for it)."""
    return outcome if result_type is None else result_type_of(result_type).read(outcome)
