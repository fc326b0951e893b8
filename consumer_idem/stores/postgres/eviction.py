"""Evicting records: an owner cleaning up after itself, or an operator making a key new work.

A delete drops the record's cache entry before and after it (fenced: a read racing the delete
cannot re-cache it), and an operator's evict never loses the key's work: an acked delivery's
kept original is armed for re-dispatch in the same transaction (see `RedispatchOutbox`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from consumer_idem.commit import commit, rollback
from consumer_idem.errors import KeyHeld, LeaseLost
from consumer_idem.types import Eviction, Status

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

# the store's own logger: its records keep the name an application filters on
log = logging.getLogger("consumer_idem.stores.postgres.store")

T = TypeVar("T")


class Evictions:
    """One store's deletes of single records (see
    [`PostgresStore.evict_record`][consumer_idem.PostgresStore.evict_record])."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def evict(self, scope: str, key: str, *, token: uuid.UUID | None = None) -> bool:
        """Delete a record (see [`PostgresStore.evict`][consumer_idem.PostgresStore.evict])."""
        if token is None:
            eviction = await self.store.evict_record(scope, key)
            if eviction is not None and eviction.held_until is not None:
                raise KeyHeld(scope, key, eviction.held_until)
            return eviction is not None
        store = self.store
        sql = f"DELETE FROM {store.table} WHERE scope = $1 AND key = $2 AND owner_token = $3"

        async def call(c: Any) -> Any:
            return await c.execute(sql, scope, key, token, timeout=store.command_timeout)

        tag: str = await self.uncached("evict", scope, key, call)
        deleted = tag.endswith(" 1")
        if not deleted:
            store.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"evict: ({scope!r}, {key!r}) is no longer held by this owner")
        return deleted

    async def evict_record(self, scope: str, key: str, *, while_held: bool) -> Eviction | None:
        """An operator's evict (see
        [`PostgresStore.evict_record`][consumer_idem.PostgresStore.evict_record])."""
        store = self.store

        async def call(c: Any) -> Eviction | None:
            # Two statements in one transaction: the DELETE waits for a keep_original holding
            # the row (FOR SHARE), and the outbox statement then sees what it kept (one
            # statement's snapshot would predate the wait and orphan the kept original).
            await c.execute("BEGIN")
            try:
                status = await c.fetchval(
                    f"DELETE FROM {store.table} WHERE scope = $1 AND key = $2 AND ($3"
                    " OR status <> 'in_progress' OR locked_until <= clock_timestamp())"
                    " RETURNING status",
                    scope,
                    key,
                    while_held,
                    timeout=store.command_timeout,
                )
                eviction = None
                if status is not None:
                    source = await store.redispatch.after_evict(c, scope, key, Status(status))
                    eviction = Eviction(scope, key, Status(status), source)
                else:
                    held = await c.fetchval(
                        f"SELECT locked_until FROM {store.table} WHERE scope = $1 AND key = $2"
                        " AND status = 'in_progress'",
                        scope,
                        key,
                        timeout=store.command_timeout,
                    )
                    if held is not None:
                        eviction = Eviction(scope, key, Status.IN_PROGRESS, held_until=held)
                await commit(c)
            except BaseException:
                await rollback(c)
                raise
            return eviction

        eviction = await self.uncached("evict", scope, key, call)
        if eviction is not None and eviction.evicted:
            log.warning(
                "scope=%s key=%s: evicted by an operator (was %s)%s",
                scope,
                key,
                eviction.status,
                ""
                if eviction.redispatch_to is None
                else f"; its original is armed for re-dispatch to {eviction.redispatch_to}",
                extra={"scope": scope, "key": key},
            )
        return eviction

    async def uncached(
        self, operation: str, scope: str, key: str, call: Callable[[Any], Awaitable[T]]
    ) -> T:
        """Run a delete of a record with its cache entry dropped before and after (fenced: a
        read racing the delete cannot re-cache it)."""
        store = self.store
        if store.cache is not None:
            await store.cache.delete([(scope, key)])
        result = await store.run(operation, scope, None, call)
        if store.cache is not None:
            await store.cache.delete([(scope, key)])
        return result
