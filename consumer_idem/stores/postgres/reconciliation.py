"""Settling ``unknown`` records: resolve, reschedule, hand to an operator, find due notices.

A resolution and the kept original message it arms or drops (``redispatch.py``) commit in one
transaction, so a "not executed" answer can never lose the message it must run again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncpg

from consumer_idem.commit import commit, rollback
from consumer_idem.errors import NotUnknown
from consumer_idem.notice import Notice, PendingRedispatch
from consumer_idem.stores.base import seconds
from consumer_idem.stores.results import encode_result
from consumer_idem.types import Executed, NotExecuted, Record, Resolution

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.stores.postgres.reconciliation")


class Reconciliation:
    """The reconciliation side of the Postgres store (``store.reconciliation``)."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def settle(
        self,
        scope: str,
        key: str,
        resolution: Resolution,
        *,
        retention: timedelta | float | None = None,
        conn: asyncpg.Connection | None = None,
        notice: Notice | None = None,
        due_in: timedelta | float = 0.0,
    ) -> tuple[Record, PendingRedispatch | None]:
        """`resolve`, returning the armed re-dispatch too ("not executed" with an original
        kept, or carried by ``notice``; due after ``due_in``)."""
        retention_td = self.store.retention_for(scope, retention)
        if isinstance(resolution, Executed):
            response = resolution.response
            sql = (
                f"UPDATE {self.store.table} SET status = 'completed', result = $3::json,"
                " result_kind = $4, http_status = $5, http_headers = $6::jsonb, http_body = $7,"
                " completed_at = now(), updated_at = now(), expires_at = now() + $8::interval,"
                " reconcile_after = NULL"
                " WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
            )
            args: tuple[Any, ...] = (
                encode_result(resolution.result),
                resolution.result_kind.value,
                response.status if response else None,
                json.dumps(dict(response.headers)) if response else None,
                response.body if response else None,
                retention_td,
            )
        else:
            sql = (
                f"UPDATE {self.store.table} SET status = 'failed_retryable', last_error = $3,"
                " reconcile_after = NULL, updated_at = now(),"
                " expires_at = greatest(expires_at, now() + $4::interval)"
                " WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
            )
            args = (resolution.reason, retention_td)

        async def call(c: Any) -> tuple[Any, PendingRedispatch | None]:
            # Two statements in one transaction (ours, or the caller's): the record's UPDATE
            # waits for a keep_original holding the row, and the next statement then sees
            # what it kept. One statement would miss it (its snapshot predates the wait).
            own = not c.is_in_transaction()
            if own:
                await c.execute("BEGIN")
            try:
                row = await c.fetchrow(sql, scope, key, *args, timeout=self.store.command_timeout)
                entry = None
                if row is not None:
                    entry = await self.store.redispatch.settle_original(
                        c, scope, key, resolution, notice, due_in
                    )
                if own:
                    await commit(c)
            except BaseException:
                if own:
                    await rollback(c)
                raise
            return row, entry

        row, entry = await self.store.run("resolve", scope, conn, call)
        if row is None:
            raise NotUnknown(f"({scope!r}, {key!r}) is not unknown; nothing to resolve")
        self.store.metrics.inc("reconcile_resolved", scope)
        log.info(
            "scope=%s key=%s: reconciled: %s -> %s%s",
            scope,
            key,
            "executed" if isinstance(resolution, Executed) else "not executed",
            row["status"],
            "" if entry is None else f" (original armed for re-dispatch to {entry.notice.source})",
            extra={"scope": scope, "key": key},
        )
        record = Record.from_row(row)
        if conn is None:
            await self.store.remember(record)
        return record, entry

    async def _unknown_update(
        self, operation: str, scope: str, key: str, assignments: str, *args: Any
    ) -> Record:
        sql = (
            f"UPDATE {self.store.table} SET {assignments},"
            " reconcile_attempts = reconcile_attempts + 1, updated_at = now()"
            " WHERE scope = $1 AND key = $2 AND status = 'unknown' RETURNING *"
        )
        row = await self.store.run(
            operation,
            scope,
            None,
            lambda c: c.fetchrow(sql, scope, key, *args, timeout=self.store.command_timeout),
        )
        if row is None:
            raise NotUnknown(f"({scope!r}, {key!r}) is not unknown")
        return Record.from_row(row)

    async def reschedule(
        self, scope: str, key: str, after: timedelta | float, reason: str
    ) -> Record:
        """Still unknown: ask again after ``after`` (the sweeper re-sends the notice then)."""
        record = await self._unknown_update(
            "reschedule",
            scope,
            key,
            "reconcile_after = now() + $3::interval, last_error = $4",
            seconds(after),
            reason,
        )
        self.store.metrics.inc("reconcile_scheduled", scope)
        return record

    async def hand_to_operator(self, scope: str, key: str, reason: str) -> Record:
        """Reconciliation gave up: the record stays ``unknown``, no longer scheduled, for a
        person to settle (``resolve`` still works)."""
        record = await self._unknown_update(
            "hand_to_operator",
            scope,
            key,
            "reconcile_after = NULL, last_error = $3",
            f"operator: {reason}"[:500],
        )
        self.store.metrics.inc("reconcile_failed", scope)
        log.error(
            "scope=%s key=%s: reconciliation gave up, handed to an operator (stays unknown): %s",
            scope,
            key,
            reason,
            extra={"scope": scope, "key": key},
        )
        return record

    async def due_notices(
        self, limit: int = 100, scopes: Sequence[str] | None = None
    ) -> list[Record]:
        """``unknown`` records whose notification is due: never published (a crash between
        parking and publishing), or rescheduled and due again. The outbox of reconciliation."""
        sql = (
            f"SELECT * FROM {self.store.table} WHERE status = 'unknown'"
            " AND reconcile_after <= now()"
            " AND (reconcile_published_at IS NULL OR reconcile_published_at < reconcile_after)"
            " AND ($2::text[] IS NULL OR scope = ANY($2::text[]))"
            " ORDER BY reconcile_after LIMIT $1"
        )
        wanted = None if scopes is None else list(scopes)
        rows = await self.store.run(
            "due_notices",
            "",
            None,
            lambda c: c.fetch(sql, limit, wanted, timeout=self.store.command_timeout),
        )
        return [Record.from_row(r) for r in rows]

    async def mark_reconcile_published(self, scope: str, key: str) -> bool:
        """Record that the reconciliation notice of an ``unknown`` record was published, so the
        sweeper does not publish it again before it is due."""
        sql = (
            f"UPDATE {self.store.table} SET reconcile_published_at = now()"
            " WHERE scope = $1 AND key = $2 AND status = 'unknown'"
        )
        status: str = await self.store.run(
            "mark_published",
            scope,
            None,
            lambda c: c.execute(sql, scope, key, timeout=self.store.command_timeout),
        )
        return status.endswith(" 1")

    async def resolve_not_executed(
        self,
        scope: str,
        key: str,
        resolution: NotExecuted,
        notice: Notice | None = None,
        *,
        due_in: timedelta | float = timedelta(seconds=60),
    ) -> PendingRedispatch | None:
        """Resolve an ``unknown`` record as not executed and, in the same transaction, arm its
        original message for a re-dispatch (due after ``due_in``): the one kept by
        `keep_original`, else the one ``notice`` carries. Returns the armed outbox row
        (send it, then `redispatch_done`), or None when no original exists anywhere (no
        delivery of it was acked: the broker delivers it again). A crash after this commit
        cannot lose the work: the sweeper sends every due armed row. Raises
        [`NotUnknown`][consumer_idem.NotUnknown] if the record is not ``unknown``."""
        _, entry = await self.settle(scope, key, resolution, notice=notice, due_in=due_in)
        return entry

    async def resolve_with_redispatch(
        self,
        scope: str,
        key: str,
        resolution: NotExecuted,
        notice: Notice,
        *,
        due_in: timedelta | float = timedelta(seconds=60),
    ) -> int:
        """`resolve_not_executed` for a notice that carries the original; returns the
        armed outbox row's id."""
        if not notice.original:
            raise ValueError("a re-dispatch needs the notice's source and original body")
        entry = await self.resolve_not_executed(scope, key, resolution, notice, due_in=due_in)
        assert entry is not None
        return entry.id
