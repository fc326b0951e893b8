"""Claiming ahead: on a connection that runs units back to back (the Kafka partition worker's
run of one-by-one units), the next unit's BEGIN and claim ride in the round trip of this unit's
COMMIT, right after it: 3 round trips a unit instead of 4.

The state belongs to the run: an `AheadRun` for one connection, entered by the caller
that runs the units (``async with store.fast_path.run_on(conn) as run``) and found by the
claim engine through the task's context (`running_on`), never through a table keyed by
connection. It holds the claim asked for (`Ahead`, sent with the next COMMIT) and the
one begun (its transaction open) that the next unit has not taken yet.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncpg

from consumer_idem.commit import mark_lost, new_mark, rollback

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.stores.postgres.fast_path")

#: set (session-level) to a transaction's mark by the check of a COMMIT that carries the next
#: unit's claim: it outlives the transaction only if that COMMIT committed (a setting made in a
#: transaction that aborts is undone with it)
DONE_SETTING = "consumer_idem.done"


@dataclass(eq=False, slots=True)
class Ahead:
    """The next unit's BEGIN and claim, sent in the round trip of this unit's COMMIT, right
    after it (3 round trips a unit instead of 4 for a connection that runs units back to back:
    the Kafka runner's partition worker). Asked for with `AheadRun.ask`, taken by the
    next unit's claim (`AheadRun.take`)."""

    scope: str
    key: str
    fingerprint: str
    retention: timedelta | float | None
    #: the mark the next unit's transaction carries (see ``consumer_idem.commit``)
    mark: str = field(default_factory=new_mark)
    #: once sent: whether the claim inserted the row (False: the key has a row already)
    claimed: bool = False

    def serves(
        self, scope: str, key: str, fingerprint: str, retention: timedelta | float | None
    ) -> bool:
        return (self.scope, self.key, self.fingerprint, self.retention) == (
            scope,
            key,
            fingerprint,
            retention,
        )


_running: ContextVar[AheadRun | None] = ContextVar("consumer_idem_ahead_run", default=None)


def running_on(conn: Any) -> AheadRun | None:
    """The run this task has entered on ``conn``, if any."""
    run = _running.get()
    return run if run is not None and run.conn is conn else None


class AheadRun:
    """Units run back to back on ``conn``: the next unit's claim asked for, and the one begun
    for it. ``async with`` it around the run; leaving rolls back a claim begun and not taken
    (nothing of it is durable). ``enabled=False`` (behind a transaction pooler): nothing is
    ever asked for."""

    __slots__ = ("_token", "asked", "begun", "conn", "enabled", "store")

    def __init__(self, conn: Any, store: PostgresStore, *, enabled: bool = True) -> None:
        self.conn = conn
        self.store = store
        self.enabled = enabled
        #: the next unit's claim to send with this unit's COMMIT
        self.asked: Ahead | None = None
        #: the claim sent (its transaction open) that the next unit has not taken yet
        self.begun: Ahead | None = None
        self._token: Token[AheadRun | None] | None = None

    async def __aenter__(self) -> AheadRun:
        self._token = _running.set(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._token is not None
        _running.reset(self._token)
        self.asked = None
        if self.begun is not None:
            self.begun = None
            await rollback(self.conn)

    def ask(self, ahead: Ahead) -> None:
        """Have the next completion on the connection (the fast path's ``finish_claimed`` of a
        fresh claim) begin ``ahead``'s transaction and claim its key right after its COMMIT.
        The caller runs that unit next, and calls `forget` once the current one is
        over."""
        if self.enabled:
            self.asked = ahead

    def forget(self) -> None:
        """The current unit is over: an ahead claim it did not send is not wanted any more."""
        self.asked = None

    def pop_asked(self) -> Ahead | None:
        ahead, self.asked = self.asked, None
        return ahead

    def drop_begun(self) -> bool:
        """A claim begun ahead for a unit that took none: forgotten here, rolled back by the
        caller in the round trip of its own BEGIN. Whether there was one."""
        begun, self.begun = self.begun, None
        return begun is not None

    def take(
        self, scope: str, key: str, fingerprint: str, retention: timedelta | float | None
    ) -> Ahead | None:
        """The transaction begun ahead for this unit, its claim made: ``None`` when there is
        none. One begun for another unit (a unit answered from the cache took no claim) stays
        for the unit's own BEGIN and claim, which roll it back in their round trip."""
        ahead = self.begun
        if ahead is None or not ahead.serves(scope, key, fingerprint, retention):
            return None
        self.begun = None
        if ahead.claimed:
            self.store.metrics.inc("created", scope)
        return ahead


async def committed_before(
    conn: Any, exc: BaseException, mark: str, check_done_stmt: str, store: PostgresStore
) -> bool:
    """The round trip of our COMMIT with the next unit's claim after it failed: did our
    COMMIT happen (and the failure come after it)? False when it did not, and when that
    cannot be known (the connection is gone): the caller then classifies the failure as
    for a COMMIT alone.

    Our transaction's check (the first statement of that round trip) sets a session setting
    to its mark (see `DONE_SETTING`). A session-level setting made in a transaction
    lasts only if the transaction commits, so once whatever is left open is rolled back,
    the setting on this connection answers, whatever other sessions did meanwhile (a
    duplicate may have committed the key the moment our claim row was gone)."""
    if (
        mark_lost(exc)
        or isinstance(exc, asyncpg.InFailedSQLTransactionError)
        or check_done_stmt in str(exc)
    ):
        return False  # our check refused (or never ran): before our COMMIT
    try:
        if conn.is_closed():
            return False
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")
        done = await conn.fetchval(
            f"SELECT current_setting('{DONE_SETTING}', true)",
            timeout=store.command_timeout,
        )
    except Exception:  # the connection broke meanwhile: unknown, as for a COMMIT alone
        log.debug("reading whether the COMMIT happened failed", exc_info=True)
        return False
    return bool(done == mark)
