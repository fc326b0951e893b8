"""Which database failures are outages and which are not.

Only an outage may be waited out (:class:`StoreUnavailable`: the consumer retries, HTTP answers
503). A missing schema is a configuration error (:class:`SchemaMissing`), and data PostgreSQL
will not take is deterministic (:class:`StoreRejected`): retrying either for ever would block a
partition or burn a delivery budget for nothing.
"""

from __future__ import annotations

import asyncpg

from consumer_idem.errors import (
    ConsumerIdemError,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
)

#: SQLSTATE classes that pass: connection exception, transaction rollback (serialization,
#: deadlock), insufficient resources, operator intervention (shutdown, statement cancelled)
_TRANSIENT_CLASSES = ("08", "40", "53", "57")
#: lock not available (lock_timeout), object in use. Not 25P02 (in failed transaction): that
#: names an earlier statement of the same transaction, usually one a handler swallowed
_TRANSIENT_STATES = ("55P03", "55006", "58000", "58030")  # + system error, I/O error
#: what asyncpg says of a connection that is gone, across versions
_GONE = ("closed", "released back to the pool", "terminat", "connection was lost", "not connected")


def connection_gone(exc: BaseException) -> bool:
    """An asyncpg interface error that means the connection itself is gone."""
    if isinstance(exc, asyncpg.ConnectionDoesNotExistError):
        return True
    text = str(exc).lower()
    return any(words in text for words in _GONE)


#: undefined table / function / column, invalid schema name: migrations not applied
_SCHEMA_STATES = ("42P01", "42883", "42703", "3F000")


def kind_of(exc: BaseException) -> type[ConsumerIdemError]:
    """The library error a database failure maps to."""
    if isinstance(exc, ConsumerIdemError):
        return type(exc)  # classified already
    if isinstance(exc, OSError | TimeoutError | asyncpg.PostgresConnectionError):
        return StoreUnavailable
    if isinstance(exc, asyncpg.InternalClientError):
        return StoreUnavailable  # a query sent just as the server killed the connection
    if isinstance(exc, asyncpg.InterfaceError):
        # The driver's view of a connection that went away (closed, terminated, or handed back
        # to the pool by asyncpg after the server killed it) is an outage; any other interface
        # error is a misuse that waiting never cures (a wrong argument count, asyncpg's
        # transaction() inside a transaction it did not open).
        return StoreUnavailable if connection_gone(exc) else StoreRejected
    state = getattr(exc, "sqlstate", None)
    if isinstance(state, str):
        if state in _SCHEMA_STATES:
            return SchemaMissing
        if state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_STATES:
            return StoreUnavailable
        return StoreRejected
    if isinstance(exc, UnicodeError | ValueError | TypeError):
        return StoreRejected  # the driver could not encode what we sent: deterministic
    return StoreUnavailable  # anything else from the I/O stack: assume an outage, fail closed


MIGRATE_HINT = "run `consumer-idem migrate` (or `await store.migrate()`)"


def describe(operation: str, exc: BaseException) -> str:
    """The message of the library error for ``exc``."""
    kind = kind_of(exc)
    text = f"idempotency store {operation} failed: {type(exc).__name__}: {exc}"
    if kind is SchemaMissing:
        return f"{text}; the idempotency schema is missing or outdated: {MIGRATE_HINT}"
    return text


def is_database_outage(exc: BaseException) -> bool:
    """A database driver error (not any exception) that waiting may cure: for a handler's own
    statement failing on a lock timeout, a statement timeout, a deadlock, a serialization
    failure or a dropped connection. Anything else a handler raises is its own failure."""
    driver = isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError)
    return driver and kind_of(exc) is StoreUnavailable
