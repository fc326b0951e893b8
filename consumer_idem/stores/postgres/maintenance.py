"""Keeping the Postgres store tidy and visible: sweep, prune, stats and the key listing.

Each operation returns a frozen report
([`SweepReport`][consumer_idem.stores.postgres.maintenance.SweepReport],
[`PruneReport`][consumer_idem.stores.postgres.maintenance.PruneReport],
[`StoreStats`][consumer_idem.stores.postgres.maintenance.StoreStats],
[`KeyPage`][consumer_idem.stores.postgres.maintenance.KeyPage]) rather than a bare count, so the CLI
and any scheduler can
say what happened in the store's own terms. The long ones (sweep, prune) work in small batches
(short locks, ``SKIP LOCKED`` so several can run at once) and report after every batch through
``on_batch``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from consumer_idem.stores.base import seconds
from consumer_idem.stores.postgres.attempts import DeliveryAttempts
from consumer_idem.types import Status

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.stores.postgres.maintenance")


class PrunePolicy(StrEnum):
    DELETE = "delete"  #: expired rows are deleted
    SOFT = "soft"  #: expired rows become ``expired`` (kept for audit), and are deleted later


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep did."""

    parked: int = 0  #: expired leases parked as ``unknown`` (zombies)
    batches: int = 0  #: statements run


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What one prune did."""

    policy: PrunePolicy = PrunePolicy.DELETE
    rows: int = 0  #: deleted or soft-expired
    #: delivery attempt counts deleted (``delivery_attempts``): of the keys pruned, and those
    #: not counted for longer than their scope's retention
    attempts: int = 0
    batches: int = 0  #: statements run
    longest_statement_s: float = 0.0  #: the longest single batch statement (its lock time)
    #: False when ``max_batches`` stopped it with rows possibly left to prune
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ScopeCounts:
    """Rows of one scope per status."""

    scope: str
    in_progress: int = 0
    completed: int = 0
    failed_retryable: int = 0
    unknown: int = 0
    expired: int = 0

    def count(self, status: Status | str) -> int:
        return int(getattr(self, Status(status).value))

    @property
    def total(self) -> int:
        return sum(self.count(s) for s in Status)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Rows per status per scope, the oldest live records and the reconciliation backlog."""

    scopes: tuple[ScopeCounts, ...] = ()
    #: seconds since the oldest ``in_progress`` record was last written (None: there is none)
    oldest_in_progress_s: float | None = None
    #: seconds since the oldest ``unknown`` record was parked (None: there is none)
    oldest_unknown_s: float | None = None
    reconcile_backlog: int = 0  #: ``unknown`` records whose notice is due
    with_operator: int = 0  #: ``unknown`` records handed to a person (no longer scheduled)

    def scope(self, name: str) -> ScopeCounts | None:
        return next((s for s in self.scopes if s.scope == name), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``scopes`` maps each scope to its rows per status."""
        out = asdict(self)
        out["scopes"] = {
            s.scope: {f.name: getattr(s, f.name) for f in fields(s) if f.name != "scope"}
            for s in self.scopes
        }
        return out


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One record as the listing shows it (no result or response body)."""

    scope: str
    key: str
    status: Status
    attempts: int
    age_s: float  #: seconds since it was last written (by the database's clock)
    created_at: datetime
    updated_at: datetime
    locked_until: datetime | None
    #: ``in_progress``: seconds its lease has left (negative: expired, a sweep parks it)
    lease_left_s: float | None
    last_error: str | None
    reconcile_after: datetime | None
    reconcile_attempts: int
    #: pass as ``after`` to list the keys that follow this one
    cursor: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of `Maintenance.list_keys`."""

    keys: tuple[KeyInfo, ...] = ()
    #: ``after`` for the next page; None when this page is the last
    next_cursor: str | None = None


def encode_cursor(updated_at: datetime, scope: str, key: str) -> str:
    """An opaque cursor: the listing's sort key of the last row shown."""
    raw = json.dumps([updated_at.isoformat(), scope, key], ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode("utf-8")).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        at, scope, key = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        return datetime.fromisoformat(at), str(scope), str(key)
    except (ValueError, TypeError, binascii.Error, UnicodeError) as exc:
        raise ValueError(f"invalid cursor {cursor!r}: pass one printed by a listing") from exc


#: the listing's largest page: a page is held in memory and printed at once
MAX_PAGE = 10_000


#: the prune's default pace (rows a second); see :meth:`Maintenance.prune`
DEFAULT_PRUNE_RATE = 20_000.0


async def _wait_until(due: float, stop: asyncio.Event) -> bool:
    """Sleep until ``due`` (``time.perf_counter()``), or until ``stop`` is set: False then."""
    wait = due - time.perf_counter()
    if wait > 0 and not stop.is_set():
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns normally when the
        # task is cancelled just as the event is set (a shutdown that sets stop and cancels),
        # and the cancellation is lost
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await stop.wait()
    return not stop.is_set()


def _pace(max_rows_per_s: Any) -> float:
    """``max_rows_per_s`` as rows a second (0.0: unpaced), or a clear error before any batch."""
    if max_rows_per_s is None:
        return 0.0
    if isinstance(max_rows_per_s, bool) or not isinstance(max_rows_per_s, numbers.Real):
        raise TypeError(f"max_rows_per_s must be a number, not {max_rows_per_s!r}")
    rate = float(max_rows_per_s)
    # NaN would make every wait NaN and infinity every wait zero: both silently unpaced
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(
            f"max_rows_per_s must be a finite number of rows a second, or 0 for no pace,"
            f" not {max_rows_per_s!r}"
        )
    return rate


def _one_more_batch(
    report: PruneReport,
    picked: int,
    batch_size: int,
    elapsed: float,
    on_batch: Callable[[PruneReport], None] | None,
    *,
    rows: int = 0,
    attempts: int = 0,
) -> PruneReport:
    """``report`` after one more prune batch (``picked`` rows looked at, ``rows`` records and
    ``attempts`` counts gone, in ``elapsed`` seconds), handed to ``on_batch``."""
    report = replace(
        report,
        rows=report.rows + rows,
        attempts=report.attempts + attempts,
        batches=report.batches + 1,
        longest_statement_s=max(report.longest_statement_s, elapsed),
        # a full last batch under max_batches: there may be more
        finished=picked < batch_size,
    )
    if on_batch is not None:
        on_batch(report)
    return report


def _paced(next_at: float, started: float, picked: int, pace: float) -> float:
    """When the next prune batch may start after one of ``picked`` rows begun at ``started``
    (``time.perf_counter()``), at ``pace`` rows a second (0.0: unpaced, ``next_at`` as it is).
    A batch earns its rows' time from when it started (or was due, if later): a slow stretch
    earns no credit to be spent in a burst afterwards."""
    return max(next_at, started) + picked / pace if pace else next_at


def _checked_prune_args(
    batch_size: int,
    max_batches: int | None,
    max_rows_per_s: Any,
    audit_retention: timedelta | float,
) -> tuple[float, timedelta]:
    """Prune's pace (rows a second, 0.0: unpaced) and ``audit_retention`` as a duration,
    once its bounds are known to make sense."""
    if batch_size < 1:  # a batch of none would never finish
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if max_batches is not None and max_batches < 1:  # none run: nothing could be said
        raise ValueError(f"max_batches must be at least 1 (or None), not {max_batches}")
    pace = _pace(max_rows_per_s)
    audit_s = seconds(audit_retention)
    if audit_s < timedelta(0):  # a soft-expired row already due: this prune would delete it
        raise ValueError(f"audit_retention must not be negative, not {audit_retention!r}")
    return pace, audit_s


def _prune_statement(
    store: PostgresStore, policy: PrunePolicy, audit_s: timedelta
) -> tuple[str, tuple[Any, ...]]:
    """The statement every batch of a prune under ``policy`` runs (built once per prune),
    and its arguments after the batch size ($1), the keyset cursor ($2) and the first
    batch's now() ($3)."""
    live = "('completed', 'failed_retryable', 'expired')"
    # Oldest first, along the expiry index, each batch starting where the last one ended
    # ($2): no batch walks again over the index entries of rows deleted before it (dead
    # until vacuumed) or of old rows that are never pruned (unknown, in progress). Without
    # the ORDER BY the planner may pick a sequential scan, and a batch then reads every
    # live row stored ahead of the expired ones.
    # What had expired when the prune began ($3, the first batch's now(), which it answers;
    # LEAST skips its NULL in the first batch, and a clock stepped back since then keeps
    # each batch to its own now()): a prune ends, however long its pace makes it, and never
    # meets again the rows it soft-expired itself (their new expiry is after it began).
    due = (
        f"FROM {store.table} WHERE expires_at < least($3::timestamptz, now())"
        f" AND expires_at >= $2 AND status IN {live}"
        " ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED"
    )
    # What comes back is one row per scope (its count, the batch's last expiry, and the
    # keys only when a cache must drop them), not one per record: a batch is then a few
    # rows for the client to read, whatever its size, which matters when the prune shares
    # an event loop with live work.
    # A last row (scope NULL) counts what the batch picked and its last expiry: a picked row
    # changed meanwhile (FOR UPDATE then locks its new version, which this statement cannot
    # see to delete) is not pruned, so the pruned count alone would end the prune early.
    keys, no_keys = (", array_agg(key) AS keys", ", NULL") if store.cache is not None else ("", "")
    # The attempts counted for a pruned key go with its record (``att``): the key is new
    # work now, with a budget of its own.
    counts = DeliveryAttempts(store)
    summary = (
        f", att AS ({counts.forget_pruned('done')})"
        f" SELECT scope, count(*) AS n, max(expires_at) AS last{keys}, NULL::timestamptz AS at,"
        " NULL::bigint AS attempts FROM done GROUP BY scope"
        f" UNION ALL SELECT NULL, count(*), max(expires_at){no_keys}, now(),"
        " (SELECT count(*) FROM att) FROM d"
    )
    # The batch's rows are found again by their physical address (table and ctid), not
    # their key: they are locked (FOR UPDATE) since they were picked, so it cannot move,
    # and a batch then costs no walk down the primary key per row (random pages of an index
    # as big as the store), which is what the live reservations beside a prune waited for.
    # The table (tableoid) is part of the address: a partitioned store repeats a ctid in
    # every partition.
    at = "t.tableoid = d.rel AND t.ctid = d.tid"
    if policy is PrunePolicy.DELETE:
        # MATERIALIZED, as in sweep: evaluated once, so LIMIT bounds the batch
        sql = (
            f"WITH d AS MATERIALIZED (SELECT tableoid AS rel, ctid AS tid, expires_at {due}),"
            f" done AS (DELETE FROM {store.table} t USING d WHERE {at}"
            " RETURNING t.scope, t.key, t.expires_at)"
            f"{summary}"
        )
        return sql, ()
    sql = (
        "WITH d AS MATERIALIZED (SELECT tableoid AS rel, ctid AS tid, scope, key, status,"
        f" expires_at {due}),"
        f" gone AS (DELETE FROM {store.table} t USING d WHERE {at}"
        " AND d.status = 'expired' RETURNING t.scope, t.key, d.expires_at),"
        f" soft AS (UPDATE {store.table} t SET status = 'expired', updated_at = now(),"
        f" expires_at = now() + $4::interval FROM d WHERE {at}"
        " AND d.status <> 'expired' RETURNING t.scope, t.key, d.expires_at),"
        " done AS (SELECT * FROM gone UNION ALL SELECT * FROM soft)"
        f"{summary}"
    )
    return sql, (audit_s,)


@dataclass(frozen=True, slots=True)
class _PrunedBatch:
    """What one prune batch answered, in its own row and its scopes' rows."""

    picked: int  #: rows the batch picked (a row changed meanwhile is picked, not pruned)
    last: datetime | None  #: the last expiry among those picked (None: none picked)
    at: datetime  #: the batch's now()
    forgotten: int  #: delivery attempt counts deleted with the pruned keys
    pruned: int  #: records deleted or soft-expired


class Maintenance:
    """The store's housekeeping and inspection (``store.maintenance``)."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def sweep(
        self,
        *,
        batch_size: int = 500,
        on_batch: Callable[[SweepReport], None] | None = None,
        stop: asyncio.Event | None = None,
    ) -> SweepReport:
        """Park every in-progress record whose lease has expired as ``unknown`` (a zombie: its
        owner may have acted before it vanished), one WARNING line per key. ``stop``: set it
        to end after the batch in hand."""
        store = self.store
        # The batch is a MATERIALIZED CTE: as a subquery in FROM, the planner may rescan it
        # once per joined row, and each rescan locks (and this UPDATE parks) further rows, so
        # LIMIT would not bound the batch at all. The rows are joined back by key and owner
        # token, not by status: see migration 8 (the rows are locked, so the token is theirs).
        sql = (
            f"WITH due AS MATERIALIZED (SELECT scope, key, owner_token FROM {store.table}"
            " WHERE status = 'in_progress' AND locked_until < clock_timestamp()"
            " ORDER BY locked_until LIMIT $1 FOR UPDATE SKIP LOCKED)"
            f" UPDATE {store.table} t SET status = 'unknown', owner_token = NULL,"
            " locked_until = NULL, last_error = 'lease_expired', reconcile_after = now(),"
            " reconcile_published_at = NULL, updated_at = now()"
            " FROM due"
            " WHERE t.scope = due.scope AND t.key = due.key AND t.owner_token = due.owner_token"
            " RETURNING t.scope, t.key"
        )
        report = SweepReport()
        while True:
            rows = await store.run(
                "sweep",
                "",
                None,
                lambda c: c.fetch(sql, batch_size, timeout=store.command_timeout),
            )
            for r in rows:
                log.warning(
                    "scope=%s key=%s: lease expired with no word from its owner; parked as "
                    "unknown for reconciliation",
                    r["scope"],
                    r["key"],
                    extra={"scope": r["scope"], "key": r["key"]},
                )
            for scope, n in Counter(r["scope"] for r in rows).items():
                store.metrics.inc("zombie", scope, n)
                store.metrics.inc("unknown", scope, n)
            report = replace(report, parked=report.parked + len(rows), batches=report.batches + 1)
            if on_batch is not None:
                on_batch(report)
            if len(rows) < batch_size or (stop is not None and stop.is_set()):
                return report

    async def prune(
        self,
        *,
        policy: PrunePolicy = PrunePolicy.DELETE,
        batch_size: int = 200,
        max_batches: int | None = None,
        audit_retention: timedelta | float = timedelta(days=30),
        on_batch: Callable[[PruneReport], None] | None = None,
        stop: asyncio.Event | None = None,
        max_rows_per_s: float | None = DEFAULT_PRUNE_RATE,
    ) -> PruneReport:
        """Remove records past ``expires_at`` in small batches (short locks, SKIP LOCKED so
        several pruners can run at once). Never touches ``in_progress`` or ``unknown`` records:
        those still need an owner or an operator. With ``SOFT``, completed and failed records
        become ``expired`` (kept ``audit_retention`` longer, never replayed) and expired ones
        are deleted. ``stop``: set it to end after the batch in hand (``finished`` False).

        ``max_rows_per_s`` paces the prune (None or 0: as fast as the database goes). Every
        pruned row writes WAL (a whole page image for the first row of each page after a
        checkpoint), and the live reservations' commits wait for that WAL to reach the disk: on a
        2-core machine an unpaced prune made them about a third slower, as autovacuum would
        without its cost limit. The default keeps a prune beside live traffic gentle and still
        clears 72 million rows an hour; see the retention page to tune it.

        A row another transaction holds locked at the time is skipped (SKIP LOCKED) and left
        to the next prune, so ``finished`` says that this prune found nothing more to take."""
        pace, audit_s = _checked_prune_args(
            batch_size, max_batches, max_rows_per_s, audit_retention
        )
        stop = stop if stop is not None else asyncio.Event()  # one kind of wait, set or not
        sql, extra = _prune_statement(self.store, policy, audit_s)
        report = PruneReport(policy=policy)
        after = datetime.min.replace(tzinfo=UTC)  # the keyset cursor: expires_at of the last
        began_at: datetime | None = None  # the database's now() in the first batch
        next_at = 0.0  # pacing: when the next batch may start (0: now, and always unpaced)
        while max_batches is None or report.batches < max_batches:
            if next_at and not await _wait_until(next_at, stop):
                break  # stopped while pacing (the last batch was full: not finished)
            started = time.perf_counter()
            rows = await self._prune_batch(sql, (batch_size, after, began_at, *extra))
            elapsed = time.perf_counter() - started
            batch = await self._book_prune_batch(rows)
            began_at = began_at or batch.at
            after = after if batch.last is None else batch.last
            report = _one_more_batch(
                report,
                batch.picked,
                batch_size,
                elapsed,
                on_batch,
                rows=batch.pruned,
                attempts=batch.forgotten,
            )
            if batch.picked < batch_size or stop.is_set():
                break
            next_at = _paced(next_at, started, batch.picked, pace)
        if report.finished and not stop.is_set():
            report = await self._prune_attempts(
                report, batch_size, max_batches, pace, stop, on_batch
            )
        return report

    async def _prune_batch(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Run one prune batch: ``sql`` (see `_prune_statement`) with ``args``."""
        store = self.store

        async def batch(c: Any) -> list[Any]:
            return list(await c.fetch(sql, *args, timeout=store.command_timeout))

        return await store.run("prune", "", None, batch)

    async def _book_prune_batch(self, rows: list[Any]) -> _PrunedBatch:
        """One prune batch's bookkeeping from the ``rows`` it answered: its metrics, the
        cache's dropped keys, and what the next batch and the report need."""
        store = self.store
        scopes = [r for r in rows if r["scope"] is not None]
        # the batch's own row: what it picked, the last expiry among those (None: none) and
        # its now(), the cutoff of every later batch
        picked, last, at, forgotten = next(
            (r["n"], r["last"], r["at"], r["attempts"]) for r in rows if r["scope"] is None
        )
        for r in scopes:
            store.metrics.inc("pruned", r["scope"], r["n"])
        if store.cache is not None:  # expired records are never replayed: drop them
            await store.cache.drop_expired((r["scope"], key) for r in scopes for key in r["keys"])
        return _PrunedBatch(
            picked=picked,
            last=last,
            at=at,
            forgotten=forgotten,
            pruned=sum(r["n"] for r in scopes),
        )

    async def _prune_attempts(
        self,
        report: PruneReport,
        batch_size: int,
        max_batches: int | None,
        pace: float,
        stop: asyncio.Event,
        on_batch: Callable[[PruneReport], None] | None,
    ) -> PruneReport:
        """After the records: the delivery attempts not counted for longer than their scope's
        retention (keys dead-lettered, or whose record never committed), in batches under the
        same bounds and pace."""
        counts = DeliveryAttempts(self.store)
        scopes = await counts.scopes()
        if not scopes:  # none counted: no batch to run
            return report
        next_at = 0.0
        while max_batches is None or report.batches < max_batches:
            if next_at and not await _wait_until(next_at, stop):
                return replace(report, finished=False)
            started = time.perf_counter()
            picked, deleted = await counts.prune_old(batch_size, scopes)
            elapsed = time.perf_counter() - started
            report = _one_more_batch(
                report, picked, batch_size, elapsed, on_batch, attempts=deleted
            )
            if picked < batch_size or stop.is_set():
                break
            next_at = _paced(next_at, started, picked, pace)
        else:
            report = replace(report, finished=False)  # max_batches, with rows possibly left
        return report

    async def count_expired_leases(self) -> int:
        """``in_progress`` records whose lease has expired: what a sweep would park now."""
        sql = (
            f"SELECT count(*) FROM {self.store.table} WHERE status = 'in_progress'"
            " AND locked_until < clock_timestamp()"
        )
        return await self._count("count_expired_leases", sql)

    async def count_prunable(self) -> int:
        """Records past retention that a prune would delete or soft-expire now."""
        sql = (
            f"SELECT count(*) FROM {self.store.table} WHERE expires_at < now()"
            " AND status IN ('completed', 'failed_retryable', 'expired')"
        )
        return await self._count("count_prunable", sql)

    async def count_unknown(
        self, scopes: Collection[str] | None = None, *, scheduled_only: bool = False
    ) -> int:
        """``unknown`` records (of ``scopes``, or all), due or not; with ``scheduled_only``,
        only those reconciliation still works on (not handed to an operator)."""
        # each form names what its partial index requires (migration 8): reconcile_after for
        # the scheduled ones, updated_at (always after -infinity) for all
        sql = f"SELECT count(*) FROM {self.store.table} WHERE status = 'unknown'"
        if scheduled_only:
            sql += " AND reconcile_after IS NOT NULL"
        else:
            sql += " AND updated_at > '-infinity'"
        if scopes is None:
            return await self._count("count_unknown", sql)
        return await self._count(
            "count_unknown", sql + " AND scope = ANY($1::text[])", list(scopes)
        )

    async def _count(self, operation: str, sql: str, *args: Any) -> int:
        store = self.store
        n = await store.run(
            operation, "", None, lambda c: c.fetchval(sql, *args, timeout=store.command_timeout)
        )
        return int(n)

    async def stats(self, scope: str | None = None) -> StoreStats:
        """Rows per status per scope (all scopes, or one), the oldest in-progress and unknown
        records and the reconciliation backlog."""
        store = self.store
        where = "" if scope is None else "WHERE scope = $1"
        args: tuple[Any, ...] = () if scope is None else (scope,)
        sql = (
            "SELECT scope, status, count(*) AS n,"
            " extract(epoch FROM now() - min(updated_at)) AS oldest_s,"
            " count(*) FILTER (WHERE status = 'unknown' AND reconcile_after <= now()) AS due,"
            " count(*) FILTER (WHERE status = 'unknown' AND reconcile_after IS NULL) AS operator"
            f" FROM {store.table} {where} GROUP BY scope, status ORDER BY scope, status"
        )
        rows = await store.run(
            "stats",
            scope or "",
            None,
            lambda c: c.fetch(sql, *args, timeout=store.command_timeout),
        )
        counts: dict[str, dict[str, int]] = {}
        oldest: dict[str, float] = {}
        backlog = operator = 0
        for r in rows:
            counts.setdefault(r["scope"], {})[r["status"]] = r["n"]
            if r["status"] in (Status.IN_PROGRESS, Status.UNKNOWN):
                oldest[r["status"]] = max(oldest.get(r["status"], 0.0), float(r["oldest_s"]))
            backlog += r["due"]
            operator += r["operator"]
        return StoreStats(
            scopes=tuple(ScopeCounts(name, **by_status) for name, by_status in counts.items()),
            oldest_in_progress_s=oldest.get(Status.IN_PROGRESS),
            oldest_unknown_s=oldest.get(Status.UNKNOWN),
            reconcile_backlog=backlog,
            with_operator=operator,
        )

    def listing_query(
        self,
        *,
        statuses: Collection[Status | str] | None = None,
        scope_prefix: str | None = None,
        older_than: timedelta | float | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> tuple[str, list[Any]]:
        """The SQL and arguments of `list_keys` (one row more than ``limit``, to know
        whether another page follows). Only the filters given become conditions, and the
        statuses are literals, so the planner can use the partial index of migration 8 (whose
        predicate also asks for ``updated_at > '-infinity'``, always true, which only this
        query and `count_unknown` state)."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
        where: list[str] = []
        args: list[Any] = []

        def arg(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if statuses is not None:
            wanted = sorted({Status(s).value for s in statuses})
            if not wanted:
                raise ValueError("statuses: give at least one, or None for all")
            where.append(f"status IN ({', '.join(repr(s) for s in wanted)})")
            where.append("updated_at > '-infinity'")
        if scope_prefix:
            where.append(f"starts_with(scope, {arg(scope_prefix)})")
        if older_than is not None:
            where.append(f"updated_at < now() - {arg(seconds(older_than))}::interval")
        if after is not None:
            at, scope, key = decode_cursor(after)
            where.append(f"(updated_at, scope, key) > ({arg(at)}, {arg(scope)}, {arg(key)})")
        sql = (
            "SELECT scope, key, status, attempts, created_at, updated_at, locked_until,"
            " last_error, reconcile_after, reconcile_attempts,"
            " extract(epoch FROM now() - updated_at)::float8 AS age_s,"
            " extract(epoch FROM locked_until - clock_timestamp())::float8 AS lease_left_s"
            f" FROM {self.store.table}"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + f" ORDER BY updated_at, scope, key LIMIT {arg(limit + 1)}"
        )
        return sql, args

    async def list_keys(
        self,
        *,
        statuses: Collection[Status | str] | None = None,
        scope_prefix: str | None = None,
        older_than: timedelta | float | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> KeyPage:
        """Records oldest first (by their last write, then scope and key), filtered by status,
        scope prefix and age; ``limit`` per page, the next one from ``after`` (a page's
        ``next_cursor``). Keyset pagination: a page costs the same however deep it is. A record
        written between two pages moves to the end of the order (it is younger now): it may be
        listed again there, and is never lost from the statuses it still has."""
        sql, args = self.listing_query(
            statuses=statuses,
            scope_prefix=scope_prefix,
            older_than=older_than,
            limit=limit,
            after=after,
        )
        store = self.store
        rows = await store.run(
            "list_keys",
            "",
            None,
            lambda c: c.fetch(sql, *args, timeout=store.command_timeout),
        )
        keys = tuple(
            KeyInfo(
                scope=r["scope"],
                key=r["key"],
                status=Status(r["status"]),
                attempts=r["attempts"],
                age_s=max(0.0, r["age_s"]),
                created_at=r["created_at"],
                updated_at=r["updated_at"],
                locked_until=r["locked_until"],
                lease_left_s=r["lease_left_s"],
                last_error=r["last_error"],
                reconcile_after=r["reconcile_after"],
                reconcile_attempts=r["reconcile_attempts"],
                cursor=encode_cursor(r["updated_at"], r["scope"], r["key"]),
            )
            for r in rows[:limit]
        )
        more = len(rows) > limit
        return KeyPage(keys, keys[-1].cursor if more else None)
