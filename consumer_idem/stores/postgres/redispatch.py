"""The re-dispatch outbox: original messages kept for ``unknown`` records.

A row is either *unarmed* (``due_at`` NULL): the original message of an ``unknown`` record, kept
because a delivery of it was acked (``keep_original``), held until the record is resolved; or
*armed*: the record was resolved "not executed" and the message must be sent again (the sweeper
sends every due armed row; a confirmed send deletes it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from consumer_idem.notice import Notice, PendingRedispatch, clean_properties
from consumer_idem.stores.base import seconds
from consumer_idem.types import Executed, Resolution, Status

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore


class RedispatchOutbox:
    """The store's re-dispatch outbox (``store.redispatch``)."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    @property
    def _outbox(self) -> str:
        return f'"{self.store.schema}".redispatch_outbox'

    _OUTBOX_COLUMNS = (
        "scope, key, source, body, header_names, header_values, record_key, properties, due_at"
    )

    async def _drop(self, c: Any, scope: str, key: str) -> None:
        """Delete the key's outbox row (if any), on connection ``c``."""
        await c.execute(
            f"DELETE FROM {self._outbox} WHERE scope = $1 AND key = $2",
            scope,
            key,
            timeout=self.store.command_timeout,
        )

    @staticmethod
    def _outbox_args(notice: Notice) -> tuple[Any, ...]:
        if not notice.original:
            raise ValueError("the outbox needs the notice's source and original body")
        names = list(notice.headers)
        return (
            notice.source,
            notice.body,
            names,
            [notice.headers[n] for n in names],
            notice.record_key,
            json.dumps(notice.properties),
        )

    @staticmethod
    def _pending(row: Any) -> PendingRedispatch:
        properties = row["properties"]
        if isinstance(properties, str):
            properties = json.loads(properties)
        return PendingRedispatch(
            id=row["id"],
            notice=Notice(
                scope=row["scope"],
                key=row["key"],
                source=row["source"],
                body=bytes(row["body"]),
                headers={
                    n: bytes(v)
                    for n, v in zip(row["header_names"], row["header_values"], strict=True)
                },
                record_key=None if row["record_key"] is None else bytes(row["record_key"]),
                properties=clean_properties(properties),
            ),
            attempts=row["attempts"],
            last_error=row["last_error"],
            armed=row["due_at"] is not None,
        )

    async def keep_original(self, scope: str, key: str, notice: Notice) -> Status | None:
        """Keep the original message of an ``unknown`` record before a delivery of it is acked:
        an unarmed outbox row, held until the record is resolved (then armed or deleted in the
        resolution's transaction). Returns the record's status: the original is kept only while
        it is ``unknown``. Anything else means it was resolved meanwhile (``completed``: acking
        is right; ``failed_retryable``, in progress or gone: do not ack, let the delivery run).

        The record row is locked (``FOR SHARE``) while the original is written, so a resolution
        either comes first (and this keeps nothing) or sees what was kept. An existing unarmed
        row stays as it is (the same message); an armed one, left from an earlier round whose
        re-dispatch has not been confirmed yet, is disarmed and renumbered (its pending send no
        longer deletes it)."""
        sql = (
            f"WITH r AS (SELECT status FROM {self.store.table} WHERE scope = $1 AND key = $2"
            " FOR SHARE),"
            f" kept AS (INSERT INTO {self._outbox} AS o ({self._OUTBOX_COLUMNS})"
            " SELECT $1::text, $2::text, $3::text, $4::bytea, $5::text[], $6::bytea[], $7::bytea,"
            " $8::jsonb, NULL::timestamptz FROM r WHERE r.status = 'unknown'"
            " ON CONFLICT (scope, key) DO UPDATE SET id = DEFAULT, source = EXCLUDED.source,"
            " body = EXCLUDED.body, header_names = EXCLUDED.header_names,"
            " header_values = EXCLUDED.header_values, record_key = EXCLUDED.record_key,"
            " properties = EXCLUDED.properties, attempts = 0, last_error = NULL, due_at = NULL,"
            " created_at = now() WHERE o.due_at IS NOT NULL RETURNING 1)"
            " SELECT status FROM r"
        )
        args = self._outbox_args(notice)
        status = await self.store.run(
            "keep_original",
            scope,
            None,
            lambda c: c.fetchval(sql, scope, key, *args, timeout=self.store.command_timeout),
        )
        return None if status is None else Status(status)

    async def kept_original(self, scope: str, key: str) -> PendingRedispatch | None:
        """The outbox row of a key, armed or not (``PendingRedispatch.armed``), or None."""
        sql = f"SELECT * FROM {self._outbox} WHERE scope = $1 AND key = $2"
        row = await self.store.run(
            "kept_original",
            scope,
            None,
            lambda c: c.fetchrow(sql, scope, key, timeout=self.store.command_timeout),
        )
        return None if row is None else self._pending(row)

    async def redispatch_count(self, scope: str, key: str) -> int:
        """How many times reconciliation re-dispatched this key's original message."""
        sql = f"SELECT redispatches FROM {self.store.table} WHERE scope = $1 AND key = $2"
        count = await self.store.run(
            "redispatch_count",
            scope,
            None,
            lambda c: c.fetchval(sql, scope, key, timeout=self.store.command_timeout),
        )
        return int(count or 0)

    async def settle_original(
        self,
        c: Any,
        scope: str,
        key: str,
        resolution: Resolution,
        notice: Notice | None,
        due_in: timedelta | float,
    ) -> PendingRedispatch | None:
        """Inside a resolution's transaction: delete the kept original (executed), or arm it,
        or the one ``notice`` carries when none was kept (not executed), counting the
        re-dispatch on the record."""
        if isinstance(resolution, Executed):
            await self._drop(c, scope, key)
            return None
        arm = "id = DEFAULT, attempts = 0, last_error = NULL, due_at = now() + $3::interval"
        if notice is not None and notice.original:
            # the kept original wins over the notice's copy (the same message; it was kept
            # with everything the transport knew)
            row = await c.fetchrow(
                f"INSERT INTO {self._outbox} AS o ({self._OUTBOX_COLUMNS})"
                " VALUES ($1, $2, $4, $5, $6, $7, $8, $9::jsonb, now() + $3::interval)"
                f" ON CONFLICT (scope, key) DO UPDATE SET {arm} RETURNING *",
                scope,
                key,
                seconds(due_in),
                *self._outbox_args(notice),
                timeout=self.store.command_timeout,
            )
        else:
            row = await c.fetchrow(
                f"UPDATE {self._outbox} SET {arm} WHERE scope = $1 AND key = $2 RETURNING *",
                scope,
                key,
                seconds(due_in),
                timeout=self.store.command_timeout,
            )
        if row is None:
            return None
        await c.execute(
            f"UPDATE {self.store.table} SET redispatches = redispatches + 1"
            " WHERE scope = $1 AND key = $2",
            scope,
            key,
            timeout=self.store.command_timeout,
        )
        return self._pending(row)

    async def after_evict(self, c: Any, scope: str, key: str, evicted: Status) -> str | None:
        """Inside an operator's evict, after the record's delete: what becomes of the key's
        outbox row. An ``unknown`` or ``failed_retryable`` record stood for work that may only
        live here (its delivery was acked): the row is armed, due now (an armed one keeps its
        due time), so the sweeper sends it and the key runs again, as the evict promised.
        Returns where it goes. For any other status the row is stale and deleted."""
        if evicted in (Status.UNKNOWN, Status.FAILED_RETRYABLE):
            source: str | None = await c.fetchval(
                f"UPDATE {self._outbox} SET due_at = coalesce(due_at, now())"
                " WHERE scope = $1 AND key = $2 RETURNING source",
                scope,
                key,
                timeout=self.store.command_timeout,
            )
            return source
        await self._drop(c, scope, key)
        return None

    async def pending_redispatches(
        self, limit: int = 100, scopes: Sequence[str] | None = None, *, due_only: bool = True
    ) -> list[PendingRedispatch]:
        """Armed outbox rows whose re-dispatch is due (all armed ones with ``due_only=False``).
        Unarmed rows (originals kept for unresolved records) are never pending."""
        sql = (
            f"SELECT * FROM {self._outbox} WHERE due_at IS NOT NULL"
            " AND (NOT $3 OR due_at <= now())"
            " AND ($2::text[] IS NULL OR scope = ANY($2::text[])) ORDER BY due_at LIMIT $1"
        )
        wanted = None if scopes is None else list(scopes)
        rows = await self.store.run(
            "pending_redispatches",
            "",
            None,
            lambda c: c.fetch(sql, limit, wanted, due_only, timeout=self.store.command_timeout),
        )
        return [self._pending(r) for r in rows]

    async def redispatch_done(self, outbox_id: int) -> None:
        """The broker confirmed the re-dispatch: drop its outbox row (only that one: a row kept
        again meanwhile has a new id)."""
        sql = f"DELETE FROM {self._outbox} WHERE id = $1 AND due_at IS NOT NULL"
        await self.store.run(
            "redispatch_done",
            "",
            None,
            lambda c: c.execute(sql, outbox_id, timeout=self.store.command_timeout),
        )

    async def redispatch_failed(
        self, outbox_id: int, error: str, retry_in: timedelta | float
    ) -> None:
        """A re-dispatch attempt failed: count it, keep the error, try again after ``retry_in``."""
        sql = (
            f"UPDATE {self._outbox} SET attempts = attempts + 1, last_error = $2,"
            " due_at = now() + $3::interval WHERE id = $1 AND due_at IS NOT NULL"
        )
        await self.store.run(
            "redispatch_failed",
            "",
            None,
            lambda c: c.execute(
                sql, outbox_id, error[:500], seconds(retry_in), timeout=self.store.command_timeout
            ),
        )
