"""The store's connections: lending one, running a statement on it, and classifying what fails.

Every database failure leaves here as a library error (see ``pg_errors``): an outage as
[`StoreUnavailable`][consumer_idem.StoreUnavailable], a missing schema as
[`SchemaMissing`][consumer_idem.SchemaMissing], and only what the
message's data caused as [`StoreRejected`][consumer_idem.StoreRejected]. The store's parts all run
through
`Connections.run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from consumer_idem.errors import ConsumerIdemError, StoreRejected, StoreUnavailable
from consumer_idem.stores.postgres import errors as pg_errors

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

#: how long a refusal's check waits for a pooled connection to ask on (seconds)
_PROBE_ACQUIRE_S = 2.0

# the store's own logger: its records keep the name an application filters on
log = logging.getLogger("consumer_idem.stores.postgres.store")

T = TypeVar("T")


class Connections:
    """Pooled connections for one store, and the library error for each failure on them.

    Failures are classified through the store's own ``error_for`` and ``refuses_any_write``,
    so a subclass of the store that overrides them is still asked."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    @asynccontextmanager
    async def connection(self, conn: asyncpg.Connection | None = None) -> AsyncIterator[Any]:
        """Yield ``conn`` itself, or a pooled connection; pool failures become StoreUnavailable."""
        if conn is not None:
            yield conn
            return
        try:
            acquired = self.store.pool.acquire(timeout=self.store.command_timeout)
            connection = await acquired.__aenter__()
        except Exception as exc:
            raise self.store.error_for("acquire", exc) from exc
        try:
            yield connection
        finally:
            try:
                await acquired.__aexit__(None, None, None)
            except Exception:  # releasing a broken connection must not mask the real error
                log.debug("releasing a connection failed", exc_info=True)

    def error_for(
        self, operation: str, exc: BaseException, scope: str = "", conn: Any = None
    ) -> ConsumerIdemError:
        """The library error for a failed store operation (see
        [`PostgresStore.error_for`][consumer_idem.PostgresStore.error_for])."""
        kind = pg_errors.kind_of(exc)
        self.store.metrics.inc("store_error", scope)
        wrong_node = pg_errors.wrong_node(exc)
        if wrong_node:  # said once per episode, not once per message
            self.store.wrong_node.seen(exc, conn)
        log.log(
            logging.DEBUG if wrong_node else logging.WARNING,
            "store %s failed (%s): %s: %s",
            operation,
            kind.__name__,
            type(exc).__name__,
            exc,
            extra={"scope": scope, "operation": operation},
        )
        error = kind(pg_errors.describe(operation, exc))
        if wrong_node and isinstance(error, StoreUnavailable):
            error.said = True
        return error

    async def run(
        self,
        operation: str,
        scope: str,
        conn: asyncpg.Connection | None,
        call: Callable[[Any], Awaitable[T]],
    ) -> T:
        """Run ``call`` on ``conn`` or a pooled connection, timed, with every database failure
        turned into the library's error for it."""
        started = time.perf_counter()
        try:
            async with self.connection(conn) as c:
                try:
                    return await call(c)
                except ConsumerIdemError:
                    raise
                except Exception as exc:  # any database failure means: do not proceed
                    # classified while ``c`` is still lent: a wrong node's connection is closed
                    # here; once released, a pooled proxy refuses every call (InterfaceError)
                    error = self.store.error_for(operation, exc, scope, c)
                    failure = exc
            # asked after ``c`` is back in the pool, so a pool of one still has a connection
            if isinstance(error, StoreRejected) and await self.store.refuses_any_write():
                # the same class also says "the server takes no write at all" (54000: its
                # XID wraparound protection): then the message is not to blame; wait
                error = StoreUnavailable(
                    f"{error}; the database refuses a write that carries no message data "
                    "too: an outage of the server (XID wraparound protection? run VACUUM), "
                    "not the message's data"
                )
            raise error from failure
        finally:
            self.store.metrics.observe(operation, time.perf_counter() - started)

    async def refuses_any_write(self) -> bool:
        """Before the message is blamed for a refusal: does the server refuse a write that
        carries none of its data (an empty transaction that takes a transaction ID)? Only a
        refusal by the server says so; no free connection to ask on says nothing."""
        try:
            async with self.store.pool.acquire(timeout=_PROBE_ACQUIRE_S) as probe:
                await probe.execute(
                    "BEGIN; SELECT pg_current_xact_id(); ROLLBACK",
                    timeout=self.store.command_timeout,
                )
        except asyncpg.PostgresError:
            return True
        except Exception:  # no connection to ask on (a full pool): keep the data's verdict
            log.debug("asking whether the server takes writes failed", exc_info=True)
        return False
