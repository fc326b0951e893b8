"""Delivery attempts per key (``<schema>.delivery_attempts``, migration 0010).

A broker's redelivery counter counts every return of a message, including those another
message caused (a consumer killed by one delivery returns all it held). A delivery budget
that means "this key's own work failed N times" counts here instead: one more each time a
redelivered message is about to run its handler, in a statement committed on its own before
the handler starts, so that a crash in the handler still counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore


class DeliveryAttempts:
    """The attempts counted for keys in ``store``'s schema."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.table = f'"{store.schema}".delivery_attempts'

    async def count(self, scope: str, key: str, limit: int | None = None) -> int | None:
        """Count one more attempt of ``key``, unless ``limit`` attempts are counted already;
        returns the attempts counted, this one included, or None when none was (at the limit).
        Raises the store's error
        ([`StoreUnavailable`][consumer_idem.errors.StoreUnavailable]...)."""
        sql = (
            f"INSERT INTO {self.table} AS a (scope, key, attempts) VALUES ($1, $2, 1)"
            " ON CONFLICT (scope, key) DO UPDATE SET attempts = a.attempts + 1,"
            " updated_at = now() WHERE $3::integer IS NULL OR a.attempts < $3::integer"
            " RETURNING attempts"
        )
        counted = await self.store.run(
            "count_attempt",
            scope,
            None,
            lambda c: c.fetchval(sql, scope, key, limit, timeout=self.store.command_timeout),
        )
        return None if counted is None else int(counted)

    async def give_back(self, scope: str, key: str) -> None:
        """Take back one attempt of ``key`` counted for a run that only waited (for the store,
        or for another owner of the key): its handler never started, so it spent nothing.
        Raises the store's error."""
        sql = (
            f"UPDATE {self.table} SET attempts = attempts - 1"
            " WHERE scope = $1 AND key = $2 AND attempts > 0"
        )
        await self.store.run(
            "count_attempt",
            scope,
            None,
            lambda c: c.execute(sql, scope, key, timeout=self.store.command_timeout),
        )

    def forget_pruned(self, pruned: str) -> str:
        """A data-modifying CTE body that deletes the attempts of the keys in the CTE
        ``pruned`` (its ``scope`` and ``key``): a record pruned (or soft-expired) makes its key
        new work, whose budget starts afresh. It returns one row per attempts row deleted."""
        return (
            f"DELETE FROM {self.table} a USING {pruned} p"
            " WHERE a.scope = p.scope AND a.key = p.key RETURNING 1"
        )

    async def scopes(self) -> list[str]:
        """The scopes with attempts counted: one short walk down the primary key per scope
        (a loose index scan), however many rows each holds."""
        sql = (
            f"WITH RECURSIVE s(scope) AS (SELECT min(scope) FROM {self.table}"
            f" UNION ALL SELECT (SELECT min(scope) FROM {self.table} WHERE scope > s.scope)"
            " FROM s WHERE s.scope IS NOT NULL) SELECT scope FROM s WHERE scope IS NOT NULL"
        )
        rows = await self.store.run(
            "prune_attempts",
            "",
            None,
            lambda c: c.fetch(sql, timeout=self.store.command_timeout),
        )
        return [r["scope"] for r in rows]

    async def prune_old(self, batch_size: int, scopes: list[str]) -> tuple[int, int]:
        """Delete at most ``batch_size`` attempts rows of ``scopes`` not counted for longer
        than their scope's retention (``store.retention_for``): a key dead-lettered, or whose
        record never committed (a handler that kept killing its process rolls the claim
        back), is new work by then, as an expired record's key is. Oldest first, SKIP LOCKED
        (a row being counted is left to the next prune). Returns (rows picked, rows deleted)."""
        keep = [self.store.retention_for(scope) for scope in scopes]
        # the rows are found again by their physical address: they are locked since picked
        sql = (
            "WITH r AS (SELECT * FROM unnest($2::text[], $3::interval[]) AS r(scope, keep)),"
            " d AS MATERIALIZED (SELECT a.ctid AS tid FROM"
            f" {self.table} a JOIN r ON r.scope = a.scope WHERE a.updated_at < now() - r.keep"
            " ORDER BY a.updated_at LIMIT $1 FOR UPDATE OF a SKIP LOCKED),"
            f" gone AS (DELETE FROM {self.table} a USING d WHERE a.ctid = d.tid RETURNING 1)"
            " SELECT (SELECT count(*) FROM d) AS picked, (SELECT count(*) FROM gone) AS n"
        )
        row = await self.store.run(
            "prune_attempts",
            "",
            None,
            lambda c: c.fetchrow(sql, batch_size, scopes, keep, timeout=self.store.command_timeout),
        )
        return int(row["picked"]), int(row["n"])
