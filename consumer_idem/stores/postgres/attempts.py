"""Delivery attempts per key (``<schema>.delivery_attempts``, migration 0010).

A broker's redelivery counter counts every return of a message, including those another
message caused (a consumer killed by one delivery returns all it held). A delivery budget
that means "this key's own work failed N times" counts here instead: one more each time a
redelivered message is about to run its handler, in a statement committed on its own before
the handler starts, so that a crash in the handler still counts.
"""

from __future__ import annotations

from consumer_idem.stores.postgres.store import PostgresStore


class DeliveryAttempts:
    """The attempts counted for keys in ``store``'s schema."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.table = f'"{store.schema}".delivery_attempts'

    async def count(self, scope: str, key: str, limit: int | None = None) -> int | None:
        """Count one more attempt of ``key``, unless ``limit`` attempts are counted already;
        returns the attempts counted, this one included, or None when none was (at the limit).
        Raises the store's error (:class:`~consumer_idem.errors.StoreUnavailable`...)."""
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
