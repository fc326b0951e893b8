"""Committing a claim's transaction: a COMMIT the server refused (a failure of the work) told
apart from a store that is down (an outage to wait out), for both claim phases."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import asyncpg

from consumer_idem.errors import (
    CommitRolledBack,
    ConsumerIdemError,
    KeyInFlight,
    StoreRejected,
)
from consumer_idem.stores.postgres.errors import is_database_outage, wrong_node
from consumer_idem.stores.postgres.store import PostgresStore

T = TypeVar("T")


class Refused(Exception):
    """The transaction did not commit, and not because the store is down: the server answered
    COMMIT with an error (a deferred constraint, a serialization failure) or with ``ROLLBACK``
    (the work had aborted the transaction: an error caught without a savepoint), or a statement
    of the completion found the transaction aborted. Nothing was committed: a work failure."""


async def checked_commit(store: PostgresStore, conn: Any, scope: str, commit: Awaitable[T]) -> T:
    """Await ``commit`` (a completion ending in a checked COMMIT) and classify its failure:
    `Refused` when the server did not commit, the store's error when it is down."""
    try:
        return await commit
    except (CommitRolledBack, StoreRejected) as exc:
        # StoreRejected here: a completion statement met the transaction the work aborted
        raise Refused(str(exc)) from exc
    except ConsumerIdemError:
        raise  # classified already (StoreUnavailable, LeaseLost)
    except asyncpg.InFailedSQLTransactionError:
        # the completion met a transaction the work had aborted: the same as COMMIT -> ROLLBACK
        aborted = CommitRolledBack(
            "the transaction had been aborted (a statement failed inside it and the work went "
            "on): nothing was committed"
        )
        raise Refused(str(aborted)) from aborted
    except asyncpg.PostgresError as exc:
        if (
            isinstance(exc, asyncpg.PostgresConnectionError)
            or conn.is_closed()
            or wrong_node(exc)  # a server that cannot take writes: nothing of the work's doing
        ):
            raise store.error_for("commit", exc, scope, conn) from exc
        raise Refused(str(exc)) from exc
    except Exception as exc:
        # The commit may or may not have reached the server; both outcomes are atomic
        # (row and effect together), so the redelivery settles it: replay or execute.
        raise store.error_for("commit", exc, scope) from exc


def work_outage(store: PostgresStore, exc: BaseException) -> bool:
    """``exc``, met while the work's local writes ran with the completion, is one to wait out:
    for a driver error, as for a handler's own statement (`is_database_outage`: its
    syntax error is its own failure); for anything else, as the store sees it."""
    if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
        return is_database_outage(exc)
    return store.is_outage(exc)


def conn_closed(conn: Any) -> bool:
    """The claim's connection is gone (an OSError then came from it, not from the work's own
    calls elsewhere, such as an HTTP request to another service)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:  # taken back by the pool after the server killed it
        return True


def transaction_gone(conn: Any) -> bool:
    """Our transaction is gone although the connection is alive: the work ended it."""
    try:
        return not conn.is_closed() and not conn.is_in_transaction()
    except asyncpg.InterfaceError:
        # a pooled connection the pool took back (terminated under us): not alive, so not
        # ended by the work; the next statement on it reports the outage
        return False


def is_lock_timeout(exc: BaseException) -> bool:
    """Did ``exc`` come from a lock wait that ran out (``lock_timeout``)? Then another
    transaction holds the key's row right now: the work is in flight, the store is not down."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyInFlight | asyncpg.LockNotAvailableError):
            return True
        seen = seen.__cause__
    return False
