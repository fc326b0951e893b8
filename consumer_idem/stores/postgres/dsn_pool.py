"""A pool made from a DSN that opens itself: the pool of ``PostgresStore.from_dsn``.

An asyncpg pool can only be created inside a running event loop, so an application that builds
its store at import time (a module-level ``store = ...`` its middlewares and subscribers name)
cannot hand the store a pool yet. `DsnPool` holds the DSN and the options instead and
creates the asyncpg pool on first use, or when ``open()`` is awaited (an app's lifespan).

Many tasks using a store first at the same moment open one pool: the first starts the creation
and the others await that same creation. ``close()`` closes the pool; a later use opens a new
one (a test suite that starts and stops an app per test, each in an event loop of its own,
keeps one module-level store). A pool belongs to the event loop that opened it: using it from
another loop without closing it first is refused with a
[`ConfigurationError`][consumer_idem.ConfigurationError].
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import asyncpg

from consumer_idem.errors import ConfigurationError
from consumer_idem.stores.postgres.pooler import Pooler, create_pool, validate_pooler


class DsnPool:
    """An asyncpg pool opened on first use from ``dsn`` and ``options`` (those of
    ``asyncpg.create_pool``); ``pooler="transaction"`` adds what a transaction pooler needs."""

    def __init__(self, dsn: str, *, pooler: Pooler = None, **options: Any) -> None:
        self.dsn = dsn
        self.pooler = validate_pooler(pooler)
        self.options = options
        self._pool: asyncpg.Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the creation under way, shared by every task that needs the pool meanwhile
        self._opening: asyncio.Task[asyncpg.Pool] | None = None

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    async def open(self) -> asyncpg.Pool:
        """The asyncpg pool, created by the first call (concurrent callers share it)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            if self._loop.is_closed():  # its loop is gone, and with it the pool's sockets
                self._pool, self._opening, self._loop = None, None, None
            else:
                raise ConfigurationError(
                    "this store's pool was opened in another event loop: await "
                    "store.close() in the loop that opened it before using it in a new one"
                )
        if self._pool is not None:
            return self._pool
        if self._opening is None:
            self._loop = loop
            self._opening = loop.create_task(self._create())
        opening = self._opening
        try:
            # shielded: a caller cancelled while it waits does not cancel the others' pool
            return await asyncio.shield(opening)
        except BaseException:
            if opening.done() and self._opening is opening:
                self._opening, self._loop = None, None  # a failed creation: the next use retries
            raise

    async def _create(self) -> asyncpg.Pool:
        pool = await create_pool(self.dsn, pooler=self.pooler, **self.options)
        self._pool = pool
        return pool

    async def close(self) -> None:
        """Close the pool if one is open (waiting for its connections to come back); the next
        use opens a new one."""
        pool, opening = self._pool, self._opening
        self._pool, self._opening, self._loop = None, None, None
        if pool is None and opening is not None:
            try:
                pool = await asyncio.shield(opening)
            except Exception:  # its creation failed: nothing to close
                return
        if pool is not None:
            await pool.close()

    # --- what the store uses of a pool ----------------------------------------------------------

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        """``async with pool.acquire() as conn`` or ``conn = await pool.acquire()``."""
        return _Acquire(self, timeout)

    async def release(self, connection: Any) -> None:
        await (await self.open()).release(connection)

    # --- the queries an application runs on its pool (asyncpg's, with its options) -----------

    async def execute(self, query: str, *args: Any, **options: Any) -> str:
        return await (await self.open()).execute(query, *args, **options)

    async def fetch(self, query: str, *args: Any, **options: Any) -> list[Any]:
        return await (await self.open()).fetch(query, *args, **options)  # type: ignore[no-any-return]

    async def fetchrow(self, query: str, *args: Any, **options: Any) -> Any:
        return await (await self.open()).fetchrow(query, *args, **options)

    async def fetchval(self, query: str, *args: Any, **options: Any) -> Any:
        return await (await self.open()).fetchval(query, *args, **options)


class _Acquire:
    """A checkout of a `DsnPool`: the pool opens first, then asyncpg's checkout runs."""

    def __init__(self, pool: DsnPool, timeout: float | None) -> None:
        self._pool = pool
        self._timeout = timeout
        self._inner: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._connection().__await__()

    async def _connection(self) -> Any:
        return await (await self._pool.open()).acquire(timeout=self._timeout)

    async def __aenter__(self) -> Any:
        self._inner = (await self._pool.open()).acquire(timeout=self._timeout)
        return await self._inner.__aenter__()

    async def __aexit__(self, *exc_info: object) -> Any:
        return await self._inner.__aexit__(*exc_info)
