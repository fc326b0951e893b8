"""Decisions answered from the store's cache of completed records (Postgres stays the authority).

A completed record is committed and immutable, so a replay (or a misuse of its key) can be
answered without a round trip; anything else, or no cache at all, asks Postgres.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer_idem.types import Decision, DecisionKind, Record

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore


class CachedDecisions:
    """One store's reads and writes of its [`CompletedCache`][consumer_idem.CompletedCache], when it
    has one."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def decision(self, scope: str, key: str, fingerprint: str) -> Decision | None:
        """A replay (or misuse) answered from the cache, or None: ask Postgres."""
        store = self.store
        if store.cache is None:
            return None
        record = await store.cache.get(scope, key)
        if record is None:
            return None
        if record.fingerprint != fingerprint:
            store.metrics.inc("key_misuse", scope)
            return Decision(DecisionKind.MISUSE, record)
        store.metrics.inc("replay", scope)
        return Decision(DecisionKind.REPLAY, record)

    async def remember(self, record: Record | None) -> None:
        """Cache a record completed and committed (no-op without a cache)."""
        cache = self.store.cache
        if cache is not None and record is not None:
            await cache.put(record)
