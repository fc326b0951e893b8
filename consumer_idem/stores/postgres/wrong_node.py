"""A server that cannot take writes: said once per episode, and its connections let go.

A read-only node (a demoted primary, a standby behind a stale DNS name, a replica, a cloud
maintenance window with ``default_transaction_read_only``) or one in recovery answers every
write with an error that waiting cures: the consumer holds its deliveries and retries. Said
for each message, the warning would drown the log; it is said once per episode, with what to
check. A session keeps the read-only default it started with, and a multi-host DSN is tried
only at connect: so the connection that met it is closed, and the pool's next one finds the
writable node (``target_session_attrs=read-write``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("consumer_idem.stores.postgres")

#: an episode ends when no wrong-node error has been seen for this long (seconds)
QUIET = 30.0

ADVICE = (
    "the store's connections reach a server that cannot take writes (read-only, a standby or "
    "in recovery). Deliveries wait and resume by themselves once a writable primary answers; "
    "nothing is dead-lettered. Check: a fail-over in progress; the DSN lists every host with "
    "target_session_attrs=read-write (a multi-host DSN); it never points at a read replica; "
    "default_transaction_read_only is off on the primary"
)


class WrongNode:
    """Per store: when the current episode of wrong-node errors began, and when it was last
    seen (monotonic seconds)."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.last: float = 0.0

    def seen(self, exc: BaseException, conn: Any = None) -> None:
        """Note one wrong-node error: warn if it opens an episode; close ``conn`` (an asyncpg
        connection the error came from), so the pool connects anew."""
        now = time.monotonic()
        if self.began is None or now - self.last > QUIET:
            self.began = now
            log.warning("%s (first error: %s: %s)", ADVICE, type(exc).__name__, exc)
        self.last = now
        if conn is not None:
            terminate = getattr(conn, "terminate", None)
            if terminate is not None and not conn.is_closed():
                terminate()
