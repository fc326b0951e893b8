"""A transaction pooler between the store and PostgreSQL (PgBouncer, Supavisor, RDS Proxy...).

In transaction pooling mode each transaction may run on another server connection, and a
statement outside a transaction on yet another. Nothing may then live on a server connection
across transactions: no SQL ``PREPARE`` kept for later, no session setting, no ``LISTEN``,
and no named statement of asyncpg's cache (``statement_cache_size=0``). With
``PostgresStore(pool, pooler="transaction")`` the store needs none of them: the fast path sends
its statements as text in the transaction that runs them, the next unit's claim no longer
rides with a COMMIT (that needs a session setting to tell whether the COMMIT happened), and
HTTP ``wait`` polls instead of listening. Migrations run in one transaction and go through the
pooler too.

A pooler in session mode, or none, needs nothing: leave ``pooler`` out. Its port and host say
nothing for sure, so the mode is the deployment's to say.
[`detect_pooler`][consumer_idem.stores.postgres.pooler.detect_pooler] is an optional
probe that is certain when it answers ``"transaction"`` (two open connections served by one
server process) and inconclusive otherwise. `check_pool` refuses a pool whose
connections keep asyncpg's statement cache, which a transaction pooler breaks sooner or later.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import asyncpg

from consumer_idem.errors import ConfigurationError

#: ``None``: a direct connection or a session pooler; ``"transaction"``: a transaction pooler
Pooler = Literal["transaction"] | None

#: asyncpg's connection options a transaction pooler needs (its statement cache off)
TRANSACTION_POOL_OPTIONS: dict[str, Any] = {"statement_cache_size": 0}


def validate_pooler(pooler: object) -> Pooler:
    """``pooler`` itself, or a [`ConfigurationError`][consumer_idem.ConfigurationError] naming the
    values there are."""
    if pooler is None or pooler in get_args(Literal["transaction"]):
        return pooler  # type: ignore[return-value]  # checked against the Literal just now
    raise ConfigurationError(
        f"pooler={pooler!r}: use pooler='transaction' behind a transaction pooler (PgBouncer "
        "pool_mode=transaction and the like), or leave it out (a direct connection or a "
        "session pooler)"
    )


async def create_pool(dsn: str, *, pooler: Pooler = None, **options: Any) -> asyncpg.Pool:
    """``asyncpg.create_pool(dsn, **options)`` with what ``pooler`` needs (behind a transaction
    pooler: ``statement_cache_size=0``), for ``PostgresStore(pool, pooler=pooler)``."""
    if validate_pooler(pooler) == "transaction":
        options = {**options, **TRANSACTION_POOL_OPTIONS}
    pool = await asyncpg.create_pool(dsn, **options)
    assert pool is not None  # only None with a pool that is not awaited
    return pool


#: what a cached statement meets on another server connection: its name taken, or missing
_CACHED = (asyncpg.DuplicatePreparedStatementError, asyncpg.InvalidSQLStatementNameError)
#: a statement asyncpg's cache would keep under a name of its own (text unique to this probe)
_PROBE = "SELECT $1::int AS consumer_idem_pooler_probe"


async def check_pool(conn: asyncpg.Connection) -> None:
    """Refuse ([`ConfigurationError`][consumer_idem.ConfigurationError]) a connection that keeps
    asyncpg's statement cache,
    for a store in transaction-pooler mode. Inside one transaction (one server connection),
    a cached statement shows in ``pg_prepared_statements`` under asyncpg's name for it."""
    async with conn.transaction():
        try:
            await conn.fetchval(_PROBE, 1)
        except _CACHED as exc:
            raise _cache_on(f"{type(exc).__name__}: {exc}") from exc
        kept = await conn.fetchval(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", _PROBE
        )
    if kept:
        raise _cache_on("the probe's statement stayed prepared on the server")


def _cache_on(evidence: str) -> ConfigurationError:
    return ConfigurationError(
        "pooler='transaction' but the pool keeps asyncpg's statement cache: behind a "
        "transaction pooler its prepared statements land on other server connections. Create "
        "the pool with statement_cache_size=0 (consumer_idem.create_pool(dsn, "
        f"pooler='transaction') does) [{evidence}]"
    )


async def detect_pooler(pool: Any, *, rounds: int = 3) -> Pooler:
    """An optional start-up probe: ``"transaction"`` when two connections of ``pool``, open at
    the same time, were served by one server process (PgBouncer in transaction mode hands
    the server a statement used to the next statement of any client), ``None`` otherwise.

    Reliable one way only: a direct connection or a session pooler never shares a server
    process between two open connections, so ``"transaction"`` is certain; ``None`` may
    still be a transaction pooler that happened to pick another server process each time.
    State the mode where you know it (``PostgresStore(pool, pooler="transaction")``)."""
    async with pool.acquire(timeout=10) as first, pool.acquire(timeout=10) as second:
        for _ in range(rounds):
            try:
                # one after the other, each outside a transaction: nothing holds a server
                if await first.fetchval("SELECT pg_backend_pid()") == await second.fetchval(
                    "SELECT pg_backend_pid()"
                ):
                    return "transaction"
            except _CACHED:
                return "transaction"  # asyncpg's statement of one met the other's on its server
    return None
