"""A request whose endpoint never began: its claim is let go, as if it had never been made."""

from __future__ import annotations

from typing import Any

from consumer_idem.claim import TwoPhaseClaim
from consumer_idem.stores.postgres.store import PostgresStore


async def release_unbegun(claim: TwoPhaseClaim) -> None:
    """Delete the record a two-phase claim reserved (still ours: fenced by its token), so
    that the key runs afresh, with another body too. Nothing ran, so nothing is lost."""
    store = claim.store
    if not isinstance(store, PostgresStore) or claim.token is None:
        return
    scope, key, token = claim.scope, claim.key, claim.token
    sql = f"DELETE FROM {store.table} WHERE scope = $1 AND key = $2 AND owner_token = $3"

    async def call(conn: Any) -> Any:
        return await conn.execute(sql, scope, key, token, timeout=store.command_timeout)

    await store.run("release", scope, None, call)
