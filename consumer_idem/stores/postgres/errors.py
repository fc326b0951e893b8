"""Which database failures the message caused, and which are outages to wait out.

Who caused an error decides what happens to the message. The library's statements are fixed
text; what differs between one that succeeds and one that fails on a healthy database is the
message's key, payload or result. So only these SQLSTATE classes mean "this message's data was
refused" ([`StoreRejected`][consumer_idem.StoreRejected]: the delivery is dead-lettered at once):

* ``22`` data exception: a value out of range, text the encoding cannot hold, a JSON value
  Postgres refuses (``\\u0000`` in ``jsonb``), an invalid number;
* ``23`` integrity constraint violation: a constraint the handler's own statements (or ours)
  broke with this data;
* ``54`` program limit exceeded: an index row or a value too big, JSON nested too deep: the
  size or shape of the key or the result.

A class names no culprit for sure: ``54000`` is also the server's XID wraparound protection,
which refuses every write. So before a refusal of the library's own statement is the data's,
the store asks the server for a write that carries no message data
([`PostgresStore.refuses_any_write`][consumer_idem.PostgresStore.refuses_any_write]); refused too,
it is an outage and waits.

Plus ``25P02`` (in failed SQL transaction), which names an earlier statement of the same
transaction: the work's own failure, one a handler caught and went on (the claim engine
counts it against the delivery's attempts; it never comes from a statement on its own).

Everything else waits ([`StoreUnavailable`][consumer_idem.StoreUnavailable]: Kafka holds the
partition, RabbitMQ requeues
without spending a delivery, HTTP answers 503), whatever its class: the connection classes,
read-only transactions (``25006``: a demoted primary, a standby, a maintenance window), a
server in recovery (``57P03``), an admin shutdown, a missing or duplicate prepared statement
(``26000``, ``42P05``: a transaction pooler handing us another server connection), a feature
the server does not support (``0A000``), an internal error (``XX000``), a permission denied
(``42501``: a grant an operator fixes). Class ``42`` also waits when our own statement meets
it: a syntax error there is a bug of the deployed code, and dead-lettering a backlog for it
would throw the backlog away; the handler's own statements are its own failure (see
`is_database_outage`). A missing schema (undefined table, function, column or schema)
is a configuration error ([`SchemaMissing`][consumer_idem.SchemaMissing]).
"""

from __future__ import annotations

import asyncpg

from consumer_idem.errors import (
    ConsumerIdemError,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
)

#: SQLSTATE classes in which the message's own data was refused (see the module docstring)
DATA_CLASSES = ("22", "23", "54")
#: in failed SQL transaction: an earlier statement of the work failed and the work went on
_WORK_STATES = ("25P02",)
#: undefined table / function / column, invalid schema name: migrations not applied
_SCHEMA_STATES = ("42P01", "42883", "42703", "3F000")
#: the statement is wrong in itself (a bug of the code that sent it), except a missing grant
_CODE_CLASSES = ("42",)
_NOT_CODE_STATES = ("42501",)  # insufficient privilege: the operator's to fix
#: a node that cannot take writes: read-only transaction, cannot connect now (recovery)
WRONG_NODE_STATES = ("25006", "57P03")
#: what asyncpg says of a connection that is gone, across versions
_GONE = ("closed", "released back to the pool", "terminat", "connection was lost", "not connected")


def connection_gone(exc: BaseException) -> bool:
    """An asyncpg interface error that means the connection itself is gone."""
    if isinstance(exc, asyncpg.ConnectionDoesNotExistError):
        return True
    text = str(exc).lower()
    return any(words in text for words in _GONE)


def _state(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def kind_of(exc: BaseException) -> type[ConsumerIdemError]:
    """The library error a database failure maps to."""
    if isinstance(exc, ConsumerIdemError):
        return type(exc)  # classified already
    if isinstance(exc, asyncpg.InterfaceError) and isinstance(exc, ValueError):
        # the driver could not encode an argument (asyncpg's client-side DataError, an
        # InterfaceError and a ValueError): the value came from the message
        return StoreRejected
    state = _state(exc)
    if state is not None:
        if state in _SCHEMA_STATES:
            return SchemaMissing
        if state[:2] in DATA_CLASSES or state in _WORK_STATES:
            return StoreRejected
        return StoreUnavailable
    if isinstance(exc, UnicodeError | ValueError | TypeError) and not isinstance(
        exc, asyncpg.InterfaceError
    ):
        return StoreRejected  # the driver could not encode what we sent: deterministic
    # Anything else from the driver or the I/O stack waits: a connection gone, a protocol
    # error (a pooler's), an interface error (a library bug waiting is right for: a fixed
    # deployment carries on where this one stopped, the backlog intact).
    return StoreUnavailable


def wrong_node(exc: BaseException) -> bool:
    """``exc`` (or what it was raised from) says the server cannot take writes: read-only
    (a demoted primary, a standby, ``default_transaction_read_only``) or in recovery, or no
    host of a multi-host DSN is the writable one right now."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _state(current) in WRONG_NODE_STATES:
            return True
        if isinstance(current, asyncpg.exceptions.TargetServerAttributeNotMatched):
            return True  # a multi-host DSN's target_session_attrs: no host is writable now
        current = current.__cause__ or current.__context__
    return False


#: a prepared statement missing, or there already: what a transaction pooler does to them
_POOLER_STATES = ("26000", "42P05")
POOLER_HINT = (
    "behind a transaction pooler (PgBouncer pool_mode=transaction, a provider's pooled port)? "
    "create the store with PostgresStore(pool, pooler='transaction') and the pool with "
    "statement_cache_size=0 (consumer_idem.create_pool(dsn, pooler='transaction'))"
)
MIGRATE_HINT = "run `consumer-idem migrate` (or `await store.migrate()`)"


def describe(operation: str, exc: BaseException) -> str:
    """The message of the library error for ``exc``."""
    kind = kind_of(exc)
    text = f"idempotency store {operation} failed: {type(exc).__name__}: {exc}"
    if kind is SchemaMissing:
        return f"{text}; the idempotency schema is missing or outdated: {MIGRATE_HINT}"
    if _state(exc) in _POOLER_STATES:
        return f"{text}; {POOLER_HINT}"
    return text


def _code_error(exc: BaseException) -> bool:
    """The statement itself is wrong (syntax, a misused driver call): a bug of its code."""
    state = _state(exc)
    if state is not None:
        return state[:2] in _CODE_CLASSES and state not in _NOT_CODE_STATES
    return (
        isinstance(exc, asyncpg.InterfaceError)
        and not isinstance(exc, ValueError)
        and not connection_gone(exc)
    )


def is_database_outage(exc: BaseException) -> bool:
    """A database driver error (not any exception) that waiting may cure, for a handler's own
    statement: a dropped connection, a lock or statement timeout, a deadlock, a serialization
    failure, a read-only or recovering server, a pooler's lost prepared statement. Not what the
    data caused (classes 22, 23, 54), a missing table, or a bug of the handler's SQL (class 42
    but a missing grant, a misused driver call): those are the handler's own failure."""
    driver = isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError)
    return driver and kind_of(exc) is StoreUnavailable and not _code_error(exc)
