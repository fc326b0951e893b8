"""COMMIT, checked: the only way this library ends a transaction it owns.

A handler can also end it behind the library's back (``ROLLBACK; BEGIN`` to "recover" from an
error, or an early ``COMMIT``): the claim is then gone, or committed before the work, and a
COMMIT of the new transaction would report success for work no record guards. So every
transaction the library opens carries a transaction-local mark (`mark_sql`), checked in
the same round trip as its COMMIT (`check_sql`): a transaction without it is refused.
Handlers recover from an error with [`savepoint`][consumer_idem.commit.savepoint].

PostgreSQL answers ``COMMIT`` on an aborted transaction (a statement failed and the handler
swallowed the error without a savepoint) with the command tag ``ROLLBACK`` and no error. Taking
that for success acks a message whose effect never committed. Every commit therefore goes
through `commit` (or `execute_and_commit` for a statement batched with its COMMIT),
which reads the tag and raises [`CommitRolledBack`][consumer_idem.CommitRolledBack].
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from consumer_idem.errors import CommitRolledBack

log = logging.getLogger("consumer_idem.commit")


def check_commit_tag(tag: str) -> None:
    """Raise [`CommitRolledBack`][consumer_idem.CommitRolledBack] unless ``tag`` (a status string)
    is ``COMMIT``."""
    if tag != "COMMIT":
        raise CommitRolledBack(
            f"PostgreSQL answered COMMIT with {tag!r}: the transaction had been aborted "
            "(a statement failed inside it); nothing was committed"
        )


async def commit(conn: Any) -> None:
    """``COMMIT`` on ``conn``; raises [`CommitRolledBack`][consumer_idem.CommitRolledBack] if the
    server rolled back."""
    check_commit_tag(await conn.execute("COMMIT"))


async def execute_and_commit(conn: Any, sql: str) -> None:
    """Run ``sql`` (simple protocol, no parameters) followed by ``COMMIT`` in one round trip and
    check the commit's tag (a multi-statement simple query reports its last statement's tag)."""
    check_commit_tag(await conn.execute(f"{sql}; COMMIT"))


async def rollback(conn: Any) -> None:
    """``ROLLBACK`` if ``conn`` is still in a transaction; a connection that is gone needs none
    (nothing of its transaction was committed), so a failure here is only logged."""
    try:
        if not conn.is_closed() and conn.is_in_transaction():
            await conn.execute("ROLLBACK")
    except Exception:
        log.debug("rollback failed", exc_info=True)


@dataclass(frozen=True, slots=True)
class Rider:
    """A caller's own statement that commits with a unit of work, sent in the round trip of
    its COMMIT (the Kafka runner's consumed offset, with ``offsets_in_postgres``), and what
    to do once that COMMIT has succeeded. ``sql``: simple protocol, no parameters."""

    sql: str
    committed: Callable[[], None]


#: the transaction-local setting that marks a transaction the library opened
MARK_SETTING = "consumer_idem.tx"


#: Marks must differ from one transaction to the next on a connection, also across processes (a
#: pooler may hand a server connection on without resetting its session settings): they catch a
#: handler's own COMMIT or ROLLBACK, not an adversary. So a 64-bit random prefix per process and
#: a counter, instead of a random draw each time: the draw was a system call per transaction,
#: about 2% of a consumer's CPU with one message per transaction.
_MARK_PREFIX = secrets.token_hex(8)
_marks = itertools.count(1)


def new_mark() -> str:
    """A fresh mark for one transaction (hex: safe inside a SQL literal)."""
    return f"{_MARK_PREFIX}{next(_marks):x}"


def mark_sql(mark: str) -> str:
    """Sent right after BEGIN: gone as soon as that transaction ends, however it ends."""
    return f"SET LOCAL {MARK_SETTING} = '{mark}'"


#: the text of the error :func:`check_sql` raises (inside PostgreSQL's own error message)
MARK_LOST = "consumer-idem: the handler ended the idempotency transaction itself"


def _check(mark: str) -> str:
    current = f"current_setting('{MARK_SETTING}', true)"
    return (
        f"SELECT CASE WHEN {current} IS DISTINCT FROM {mark} THEN ('{MARK_LOST} "
        f"(COMMIT or ROLLBACK on its connection) ' || coalesce({current}, ''))::int END"
    )


def check_sql(mark: str) -> str:
    """Sent right before COMMIT: fails unless this is still the transaction marked ``mark``.
    (The failing branch depends on a setting, so the planner cannot fold it into an error.)"""
    return _check(f"'{mark}'")


def prepare_check_sql(name: str, *also: str) -> str:
    """`check_sql` as a server-side prepared statement ``name`` taking the mark: a
    connection that sends one unit after another would otherwise parse and plan the check for
    each (measured: about a fifth of Postgres' CPU per unit, with eight units at once).
    ``also``: more output columns (expressions over the mark, ``$1``), evaluated only when the
    check passes."""
    return f"PREPARE {name}(text) AS {', '.join((_check('$1'), *also))}"


def run_check_sql(name: str, mark: str) -> str:
    """Run the check prepared as ``name`` (see `prepare_check_sql`) for ``mark``."""
    return f"EXECUTE {name}('{mark}')"


def mark_lost(exc: BaseException | None) -> bool:
    """Did ``exc`` (or an error it was raised from) come from a failed `check_sql`?"""
    return any(MARK_LOST in str(e) for e in _causes(exc))


def check_gone(exc: BaseException | None) -> bool:
    """Did ``exc`` (or an error it was raised from) come from a prepared check (or another
    prepared statement) that no longer exists on the connection, so that the check never ran?"""
    return any(isinstance(e, asyncpg.InvalidSQLStatementNameError) for e in _causes(exc))


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__


@asynccontextmanager
async def savepoint(conn: Any) -> AsyncIterator[None]:
    """Recover from a failed statement inside a handler without ending the library's
    transaction: what ran inside the block is rolled back to the savepoint when it raises,
    and the exception propagates (catch it outside the block)::

        try:
            async with savepoint(conn):
                await conn.execute("INSERT INTO payments ...")
        except asyncpg.UniqueViolationError:
            ...  # the transaction is still good: go on

    (asyncpg's ``conn.transaction()`` refuses to nest in a transaction it did not open.)"""
    name = f"consumer_idem_{secrets.token_hex(4)}"
    await conn.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        await conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
        await conn.execute(f"RELEASE SAVEPOINT {name}")
        raise
    await conn.execute(f"RELEASE SAVEPOINT {name}")
