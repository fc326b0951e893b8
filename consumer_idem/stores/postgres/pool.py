"""The asyncpg pool a store is given: how to make it cost no round trip it does not need.

On every release asyncpg resets the connection for its next user: it rolls back a transaction
left open, then sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;``.
That query is one round trip per release: a third of a first execution's cost in
transactional mode (BEGIN and the claim, then the result and COMMIT; then the reset), a
quarter of a duplicate's.

The library leaves no session state on a connection it gives back: its settings are
``SET LOCAL`` (gone at the end of the transaction), its locks transaction-scoped, its LISTEN
undone before release, and its prepared statements are meant to stay. So when your handlers
leave none either, pass `no_reset` as the pool's ``reset``; asyncpg still rolls back a
transaction left open (and drops listener callbacks) before calling it.
"""

from __future__ import annotations

import asyncpg


async def no_reset(conn: asyncpg.Connection) -> None:
    """A pool ``reset`` that sends nothing: ``asyncpg.create_pool(dsn, reset=no_reset)``.

    Use it only if the code that runs on pooled connections (your handlers, your own queries)
    leaves no session state behind: no plain ``SET`` (use ``SET LOCAL``), no ``LISTEN`` of its
    own, no session advisory locks (use the ``_xact_`` ones), no ``WITH HOLD`` cursors. With
    the default reset, each release costs one more round trip, and nothing else changes."""
