"""A pool that lets another session commit at the worst moment: right after a ROLLBACK."""

from __future__ import annotations

from typing import Any

import asyncpg


class DuplicateOnRollback:
    """A pool whose connections, on their first ROLLBACK once :meth:`arm` ed, run
    ``duplicate()`` right after it: another session committing the key the moment our claim
    row is gone, as a consumer blocked on that row would."""

    def __init__(self, pool: asyncpg.Pool, duplicate: Any) -> None:
        self.pool, self.duplicate, self.armed, self.fired = pool, duplicate, False, False

    def arm(self) -> None:
        self.armed = True

    def acquire(self, *, timeout: float | None = None) -> Any:
        outer = self

        class Acquired:
            async def __aenter__(self) -> Any:
                self.inner = outer.pool.acquire(timeout=timeout)
                return _Conn(await self.inner.__aenter__(), outer)

            async def __aexit__(self, *exc: Any) -> None:
                await self.inner.__aexit__(*exc)

        return Acquired()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


class _Conn:
    def __init__(self, conn: Any, pool: DuplicateOnRollback) -> None:
        self._conn, self._pool = conn, pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def execute(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        status = await self._conn.execute(sql, *args, **kwargs)
        if sql == "ROLLBACK" and self._pool.armed and not self._pool.fired:
            self._pool.fired = True
            await self._pool.duplicate()
        return status


async def insert_completed(
    conn: Any, table: str, scope: str, key: str, fingerprint: str, result: str | None = None
) -> None:
    """A completed record of ``key``, written as another consumer's claim would be."""
    await conn.execute(
        f"INSERT INTO {table} (scope, key, fingerprint, status, result_kind, result,"
        " completed_at, expires_at) VALUES ($1, $2, $3, 'completed', 'success', $4::json,"
        " now(), now() + interval '1 day')",
        scope,
        key,
        fingerprint,
        result,
    )
