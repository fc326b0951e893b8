"""The transactional outbox's table (``store.outbox``): outgoing messages of committed units.

Not the re-dispatch outbox (``store.redispatch``: originals of ``unknown`` records that the
reconciler sends again). A row here is a message a handler published through
[`consumer_idem.outbox.outbox_for`][consumer_idem.outbox.outbox_for]; it is inserted in the unit's
own transaction (by
`Outbox.insert_sql`, in the round trip of the unit's COMMIT), so it exists exactly when the
unit committed. Its life: ``pending`` -> ``sent`` (the broker confirmed it; pruned after the
retention) or ``parked`` (the broker refuses it for good: kept, with its reason, for an operator).

The process that committed the unit sends it right away and marks it sent by its unit
coordinates (`Outbox.mark_sent`). A relay takes what is still pending once it is due
(`Outbox.claim_due`, ``FOR UPDATE SKIP LOCKED``: relays in several processes never hold
the same row) and settles it in the same transaction (`Outbox.settle_claimed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import asyncpg

from consumer_idem.stores.base import seconds
from consumer_idem.stores.postgres.fast_path import dollar_quote

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore

#: the header every outgoing message carries (the next consumer's ``header("idempotency-key")``)
IDEMPOTENCY_HEADER = "idempotency-key"


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message a unit published: where it goes, what it carries, and which unit it is of.

    ``headers`` include ``idempotency-key`` (its value is ``idempotency_key``). ``run``: the
    execution of the unit that published it (a new one each time the key runs as new work);
    ``route``: the transport and broker of the sender it is for (None: not known where it was
    published; see `consumer_idem.outbox_routes`). ``id`` and ``attempts`` are the row's,
    once read back from the table (a relay's messages)."""

    destination: str
    body: bytes
    headers: tuple[tuple[str, bytes], ...]
    key: bytes | None
    scope: str
    unit_key: str
    position: int
    idempotency_key: str
    id: int | None = None
    attempts: int = 0
    run: str | None = None
    route: str | None = None

    @property
    def group(self) -> tuple[str, str, str | None, str, bytes | None]:
        """Messages of one group keep their order: one run of a unit, one destination, one
        key."""
        return (self.scope, self.unit_key, self.run, self.destination, self.key)

    def header(self, name: str) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)


@dataclass(frozen=True, slots=True)
class OutboxScopeStats:
    """The outbox of one scope (the scope of the units that published)."""

    scope: str
    pending: int = 0  #: committed, not yet confirmed by the broker
    parked: int = 0  #: refused for good: an operator's (see :meth:`Outbox.unpark`)
    sent: int | None = None  #: sent and kept until the retention (None: not counted)
    #: seconds since the oldest pending message was committed (None: nothing pending)
    oldest_pending_s: float | None = None


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """Outbox depth and age per scope."""

    scopes: tuple[OutboxScopeStats, ...] = ()

    @property
    def pending(self) -> int:
        return sum(s.pending for s in self.scopes)

    @property
    def parked(self) -> int:
        return sum(s.parked for s in self.scopes)

    @property
    def oldest_pending_s(self) -> float | None:
        ages = [s.oldest_pending_s for s in self.scopes if s.oldest_pending_s is not None]
        return max(ages) if ages else None

    def scope(self, name: str) -> OutboxScopeStats | None:
        return next((s for s in self.scopes if s.scope == name), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: totals, and ``scopes`` mapping each scope to its figures."""
        return {
            "pending": self.pending,
            "parked": self.parked,
            "oldest_pending_s": self.oldest_pending_s,
            "scopes": {
                s.scope: {k: v for k, v in asdict(s).items() if k != "scope"} for s in self.scopes
            },
        }


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """A message the broker refused for good, as an operator sees it."""

    id: int
    scope: str
    unit_key: str
    position: int
    destination: str
    idempotency_key: str
    attempts: int
    last_error: str | None
    parked_at: datetime | None


#: A transaction that only records what became of sent messages need not wait for the disk at
#: its COMMIT: lost in a crash, the marks are undone and the messages sent again (copies the
#: next consumer drops by their key). Waiting would cost a WAL flush per dispatch, as much as
#: the unit's own commit.
LAZY_COMMIT = "SET LOCAL synchronous_commit TO OFF"
#: the same for a statement that is its own transaction: one round trip, no BEGIN/COMMIT
_LAZY = "WITH lazy AS (SELECT set_config('synchronous_commit', 'off', true))"


#: up to this many messages go into the COMMIT's query as literals; more are copied
LITERAL_MAX = 16


def _bytea(value: bytes) -> str:
    return f"decode('{value.hex()}', 'hex')"


def _text_or_null(value: str | None) -> str:
    return "NULL" if value is None else dollar_quote(value)


class Outbox:
    """The store's transactional outbox (``store.outbox``)."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        #: how long a fresh message is left to the process that committed it before a relay
        #: may send it as well (a relay sending it meanwhile would only send a duplicate)
        self.relay_after: timedelta | float = timedelta(seconds=10)

    @property
    def table(self) -> str:
        return f'"{self.store.schema}".outbox_messages'

    async def _fetch(self, operation: str, scope: str, conn: Any, sql: str, *args: Any) -> Any:
        timeout = self.store.command_timeout
        return await self.store.run(
            operation, scope, conn, lambda c: c.fetch(sql, *args, timeout=timeout)
        )

    async def _execute(self, operation: str, scope: str, conn: Any, sql: str, *args: Any) -> int:
        """Run a write; returns how many rows it changed."""
        timeout = self.store.command_timeout
        status: str = await self.store.run(
            operation, scope, conn, lambda c: c.execute(sql, *args, timeout=timeout)
        )
        return int(status.rsplit(" ", 1)[-1])

    # --- inside the unit's transaction ---------------------------------------------------------

    _COLUMNS = (
        "scope",
        "unit_key",
        "position",
        "destination",
        "message_key",
        "body",
        "header_names",
        "header_values",
        "idempotency_key",
        "run",
        "route",
    )

    async def stage(self, conn: asyncpg.Connection, messages: Sequence[OutgoingMessage]) -> str:
        """Write ``messages`` in the open transaction on ``conn``, the cheapest way: a few are
        returned as an INSERT to send in the simple query that commits the unit (no round trip
        of its own); many (a batch) are copied now (``COPY``: one exchange, and far cheaper
        for the server than parsing a long INSERT), and "" is returned. Errors are the
        driver's, as the COMMIT's would be (the caller classifies them)."""
        if len(messages) <= LITERAL_MAX:
            return self.insert_sql(messages)
        await conn.copy_records_to_table(
            "outbox_messages",
            schema_name=self.store.schema,
            columns=self._COLUMNS,
            records=[
                (
                    m.scope,
                    m.unit_key,
                    m.position,
                    m.destination,
                    m.key,
                    m.body,
                    [n for n, _ in m.headers],
                    [v for _, v in m.headers],
                    m.idempotency_key,
                    None if m.run is None else UUID(m.run),
                    m.route,
                )
                for m in messages
            ],
            timeout=self.store.command_timeout,
        )
        return ""

    def insert_sql(self, messages: Sequence[OutgoingMessage]) -> str:
        """One INSERT of ``messages`` as SQL literals (see `stage`). Empty when there
        is nothing to insert."""
        if not messages:
            return ""
        rows = []
        for m in messages:
            names = ", ".join(dollar_quote(n) for n, _ in m.headers)
            values = ", ".join(_bytea(v) for _, v in m.headers)
            rows.append(
                f"({dollar_quote(m.scope)}, {dollar_quote(m.unit_key)}, {int(m.position)},"
                f" {dollar_quote(m.destination)},"
                f" {'NULL' if m.key is None else _bytea(m.key)}, {_bytea(m.body)},"
                f" ARRAY[{names}]::text[], ARRAY[{values}]::bytea[],"
                f" {dollar_quote(m.idempotency_key)}, {_text_or_null(m.run)}::uuid,"
                f" {_text_or_null(m.route)})"
            )
        return f"INSERT INTO {self.table} ({', '.join(self._COLUMNS)}) VALUES {', '.join(rows)}"

    # --- after the commit: the committing process ----------------------------------------------

    @staticmethod
    def _units(messages: Sequence[OutgoingMessage]) -> str:
        """The rows of ``messages`` (by their unit coordinates), in a statement that commits
        without waiting for the disk (see `LAZY_COMMIT`). Literals, sent as a simple
        query: planned for these very rows each time. A prepared statement settles on a generic
        plan after a few runs, and one made for a handful of rows (a consumer's single units)
        compares every row to every other once a batch marks a thousand."""
        scopes = ", ".join(dollar_quote(m.scope) for m in messages)
        keys = ", ".join(dollar_quote(m.unit_key) for m in messages)
        positions = ", ".join(str(int(m.position)) for m in messages)
        runs = ", ".join(_text_or_null(m.run) for m in messages)
        # the run too: an earlier run of the key may still have its own rows pending
        return (
            f" FROM unnest(ARRAY[{scopes}]::text[], ARRAY[{keys}]::text[],"
            f" ARRAY[{positions}]::int[], ARRAY[{runs}]::uuid[]) AS u(s, k, p, r), lazy"
            " WHERE t.scope = u.s AND t.unit_key = u.k AND t.position = u.p"
            " AND t.run IS NOT DISTINCT FROM u.r AND t.status = 'pending'"
        )

    async def mark_sent(self, messages: Sequence[OutgoingMessage]) -> int:
        """The broker confirmed ``messages``: mark them sent (by their unit coordinates, which
        name one logical message: any copy of it is a duplicate the next consumer drops).
        Returns how many rows changed."""
        if not messages:
            return 0
        sql = (
            f"{_LAZY} UPDATE {self.table} t SET status = 'sent', sent_at = now(),"
            f" attempts = t.attempts + 1{self._units(messages)}"
        )
        return await self._execute("outbox_sent", messages[0].scope, None, sql)

    async def mark_failed(
        self, messages: Sequence[OutgoingMessage], error: str, retry_in: timedelta | float
    ) -> None:
        """A send failed for a reason that may pass: count it, keep the error, and leave the
        messages to a relay after ``retry_in``."""
        if not messages:
            return
        sql = (
            f"{_LAZY} UPDATE {self.table} t SET attempts = t.attempts + 1,"
            f" last_error = {dollar_quote(error[:500])},"
            f" due_at = now() + make_interval(secs => {seconds(retry_in).total_seconds()!r})"
            f"{self._units(messages)}"
        )
        await self._execute("outbox_failed", messages[0].scope, None, sql)

    async def park(self, messages: Sequence[OutgoingMessage], reason: str) -> None:
        """The broker refuses these messages for good: park them, with the reason."""
        if not messages:
            return
        sql = (
            f"{_LAZY} UPDATE {self.table} t SET status = 'parked', parked_at = now(),"
            f" attempts = t.attempts + 1, last_error = {dollar_quote(reason[:500])}"
            f"{self._units(messages)}"
        )
        await self._execute("outbox_park", messages[0].scope, None, sql)

    # --- the relay -----------------------------------------------------------------------------

    @staticmethod
    def _message(row: Any) -> OutgoingMessage:
        return OutgoingMessage(
            destination=row["destination"],
            body=bytes(row["body"]),
            headers=tuple(
                (n, bytes(v))
                for n, v in zip(row["header_names"], row["header_values"], strict=True)
            ),
            key=None if row["message_key"] is None else bytes(row["message_key"]),
            scope=row["scope"],
            unit_key=row["unit_key"],
            position=row["position"],
            idempotency_key=row["idempotency_key"],
            id=row["id"],
            attempts=row["attempts"],
            run=None if row["run"] is None else str(row["run"]),
            route=row["route"],
        )

    async def claim_due(
        self,
        conn: asyncpg.Connection,
        limit: int,
        scopes: Sequence[str] | None = None,
        route: str | None = None,
        upto: int | None = None,
    ) -> list[OutgoingMessage]:
        """Inside the caller's transaction on ``conn``: lock up to about ``limit`` due pending
        messages (ids up to ``upto``; None: any) for ``route`` (the relay's sender's) that no other
        relay holds, shared out between their destinations, each destination's in publishing order.
        Rows with no route (written before version 9, or where no sender was attached) are taken
        only when ``scopes`` names the scopes to take. Due: older than `relay_after` (never
        tried), or past the backoff of a failed attempt. A destination with a message backing off is
        held as a whole, in the query: it never takes the place of one that can be sent. A message
        waits while an earlier one of its run, destination and key is pending and not among them
        (held by another relay): order is kept per destination key. The transaction's COMMIT will
        not wait for the disk (`LAZY_COMMIT`)."""
        table = self.table
        mine = (
            "coalesce(route, '') = ANY($4::text[])"
            " AND ($2::text[] IS NULL OR scope = ANY($2::text[])) AND id <= $5"
            " AND (due_at <= now() OR (due_at IS NULL AND created_at <= now() - $3::interval))"
        )
        sql = (
            # the destinations with something pending, one index probe each (not a read of
            # every pending row: a backlog must not slow each batch down)
            "WITH RECURSIVE dests AS (SELECT s.r, s.d FROM unnest($4::text[]) AS x(r)"
            f" CROSS JOIN LATERAL (SELECT x.r AS r, destination AS d FROM {table}"
            " WHERE status = 'pending' AND coalesce(route, '') = x.r ORDER BY destination"
            " LIMIT 1) s UNION ALL SELECT n.r, n.d FROM dests CROSS JOIN LATERAL"
            f" (SELECT dests.r AS r, destination AS d FROM {table} WHERE status = 'pending'"
            " AND coalesce(route, '') = dests.r AND destination > dests.d"
            " ORDER BY destination LIMIT 1) n),"
            # those with something due, oldest first, but none backing off
            " open AS (SELECT dests.r, dests.d, f.first FROM dests CROSS JOIN LATERAL"
            f" (SELECT id AS first FROM {table} WHERE status = 'pending'"
            f" AND coalesce(route, '') = dests.r AND destination = dests.d AND {mine}"
            " ORDER BY id LIMIT 1) f WHERE NOT EXISTS (SELECT 1 FROM"
            f" {table} h WHERE h.status = 'pending' AND h.due_at IS NOT NULL"
            " AND coalesce(h.route, '') = dests.r AND h.destination = dests.d"
            " AND h.due_at > now()) ORDER BY f.first LIMIT $1),"
            # each its share of the batch, in publishing order
            " picked AS (SELECT p.id FROM open CROSS JOIN LATERAL (SELECT id"
            f" FROM {table} WHERE status = 'pending' AND coalesce(route, '') = open.r"
            f" AND destination = open.d AND {mine} ORDER BY id"
            " LIMIT greatest(1, $1 / (SELECT count(*) FROM open))"
            " FOR UPDATE SKIP LOCKED) p)"
            f" SELECT o.* FROM {table} o JOIN picked USING (id)"
            f" WHERE NOT EXISTS (SELECT 1 FROM {table} e WHERE e.status = 'pending'"
            " AND e.scope = o.scope AND e.unit_key = o.unit_key AND e.position < o.position"
            " AND e.run IS NOT DISTINCT FROM o.run AND e.destination = o.destination"
            " AND e.message_key IS NOT DISTINCT FROM o.message_key"
            " AND e.id NOT IN (SELECT id FROM picked))"
            " ORDER BY o.id"
        )
        wanted = None if scopes is None else list(scopes)
        # "": rows nobody routed, taken only by a relay that names the scopes it serves
        routes = ([] if route is None else [route]) + ([""] if wanted is not None else [])
        await self.store.run("outbox_claim", "", conn, lambda c: c.execute(LAZY_COMMIT))
        rows = await self._fetch(
            "outbox_claim",
            "",
            conn,
            sql,
            limit,
            wanted,
            seconds(self.relay_after),
            routes,
            (1 << 63) - 1 if upto is None else upto,
        )
        return [self._message(r) for r in rows]

    async def newest_id(self) -> int:
        """The id of the newest message (0: none): a relay pass takes none newer."""
        sql = f"SELECT coalesce(max(id), 0) AS n FROM {self.table}"
        rows = await self._fetch("outbox_newest", "", None, sql)
        return int(rows[0]["n"])

    async def settle_claimed(
        self,
        conn: asyncpg.Connection,
        sent: Sequence[OutgoingMessage],
        failed: Sequence[tuple[OutgoingMessage, str, float]] = (),
        parked: Sequence[tuple[OutgoingMessage, str]] = (),
    ) -> None:
        """Inside the relay's transaction: what became of the messages `claim_due` locked
        (``failed``: (message, error, seconds before it is due again); ``parked``: (message,
        reason)). Literals, as in `_units`: in an outage every row of a batch fails, and
        the rows pending are many. By id alone: `claim_due` locked these rows, so they
        are still pending, and ``AND status = 'pending'`` would let the planner take the
        partial index of unsent messages (priced by its last vacuum) for the primary key and
        walk it whole: during a backlog, every batch of the relay read the backlog."""

        def ids(messages: Sequence[OutgoingMessage]) -> str:
            return f"ARRAY[{', '.join(str(int(m.id or 0)) for m in messages)}]::bigint[]"

        def texts(values: Sequence[str]) -> str:
            return f"ARRAY[{', '.join(dollar_quote(v[:500]) for v in values)}]::text[]"

        if sent:
            await self._execute(
                "outbox_sent",
                "",
                conn,
                f"UPDATE {self.table} t SET status = 'sent', sent_at = now(),"
                f" attempts = t.attempts + 1 FROM unnest({ids(sent)}) AS u(i)"
                " WHERE t.id = u.i",
            )
        if failed:
            delays = ", ".join(repr(float(d)) for _, _, d in failed)
            await self._execute(
                "outbox_failed",
                "",
                conn,
                f"UPDATE {self.table} t SET attempts = t.attempts + 1, last_error = u.e,"
                " due_at = now() + make_interval(secs => u.d)"
                f" FROM unnest({ids([m for m, _, _ in failed])},"
                f" {texts([e for _, e, _ in failed])}, ARRAY[{delays}]::float8[]) AS u(i, e, d)"
                " WHERE t.id = u.i",
            )
        if parked:
            await self._execute(
                "outbox_park",
                "",
                conn,
                f"UPDATE {self.table} t SET status = 'parked', parked_at = now(),"
                " attempts = t.attempts + 1, last_error = u.e"
                f" FROM unnest({ids([m for m, _ in parked])}, {texts([r for _, r in parked])})"
                " AS u(i, e) WHERE t.id = u.i",
            )

    # --- operators -----------------------------------------------------------------------------

    async def stats(self, scope: str | None = None, *, count_sent: bool = True) -> OutboxStats:
        """Pending and parked messages and the age of the oldest pending one, per scope; with
        ``count_sent``, also the sent messages still kept (a scan of them: not for a metric)."""
        sql = (
            "SELECT scope, count(*) FILTER (WHERE status = 'pending') AS pending,"
            " count(*) FILTER (WHERE status = 'parked') AS parked,"
            " extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))"
            "::float8 AS oldest"
            f" FROM {self.table} WHERE status IN ('pending', 'parked')"
            " AND ($1::text IS NULL OR scope = $1) GROUP BY scope"
        )
        rows = await self._fetch("outbox_stats", scope or "", None, sql, scope)
        figures: dict[str, dict[str, Any]] = {
            r["scope"]: {"pending": r["pending"], "parked": r["parked"], "oldest": r["oldest"]}
            for r in rows
        }
        if count_sent:
            sent_sql = (
                f"SELECT scope, count(*) AS sent FROM {self.table} WHERE status = 'sent'"
                " AND ($1::text IS NULL OR scope = $1) GROUP BY scope"
            )
            for r in await self._fetch("outbox_stats", scope or "", None, sent_sql, scope):
                figures.setdefault(r["scope"], {})["sent"] = r["sent"]
        return OutboxStats(
            tuple(
                OutboxScopeStats(
                    scope=name,
                    pending=f.get("pending", 0),
                    parked=f.get("parked", 0),
                    sent=f.get("sent", 0) if count_sent else None,
                    oldest_pending_s=(
                        None if f.get("oldest") is None else max(0.0, float(f["oldest"]))
                    ),
                )
                for name, f in sorted(figures.items())
            )
        )

    async def parked(self, limit: int = 100, scope: str | None = None) -> list[ParkedMessage]:
        """Parked messages, oldest first."""
        sql = (
            "SELECT id, scope, unit_key, position, destination, idempotency_key, attempts,"
            f" last_error, parked_at FROM {self.table} WHERE status = 'parked'"
            " AND ($2::text IS NULL OR scope = $2) ORDER BY id + 0 LIMIT $1"  # (see claim_due)
        )
        rows = await self._fetch("outbox_parked", scope or "", None, sql, limit, scope)
        return [ParkedMessage(**dict(r)) for r in rows]

    async def unpark(self, ids: Sequence[int] | None = None, scope: str | None = None) -> int:
        """Send parked messages again (the destination was fixed): pending, due now. ``ids``
        and ``scope`` narrow it down; with neither, every parked message. Returns how many."""
        sql = (
            f"UPDATE {self.table} SET status = 'pending', due_at = now(), parked_at = NULL"
            " WHERE status = 'parked' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))"
            " AND ($2::text IS NULL OR scope = $2)"
        )
        return await self._execute(
            "outbox_unpark", scope or "", None, sql, None if ids is None else list(ids), scope
        )

    async def stranded(
        self, scopes: Sequence[str], routes: Sequence[str], older_than: timedelta | float
    ) -> list[tuple[str, str, int]]:
        """(scope, route, count) of the messages of ``scopes`` pending for a route other than
        ``routes`` (one no relay of these scopes sends) for longer than ``older_than``."""
        sql = (
            f"SELECT scope, route, count(*) AS n FROM {self.table} WHERE status = 'pending'"
            " AND scope = ANY($1::text[]) AND route IS NOT NULL AND route <> ALL($2::text[])"
            " AND created_at <= now() - $3::interval GROUP BY scope, route ORDER BY scope, route"
        )
        rows = await self._fetch(
            "outbox_stranded", "", None, sql, list(scopes), list(routes), seconds(older_than)
        )
        return [(r["scope"], r["route"], r["n"]) for r in rows]

    async def reroute(self, old: str, new: str, *, scope: str | None = None) -> int:
        """Move the messages pending for route ``old`` (of ``scope``; None: every scope) to
        route ``new``, due now: the same cluster spelled otherwise by a new configuration, or a
        scope moved to another broker. Each keeps its ``idempotency-key``. Returns how many."""
        sql = (
            f"UPDATE {self.table} SET route = $2, due_at = now() WHERE status = 'pending'"
            " AND route = $1 AND ($3::text IS NULL OR scope = $3)"
        )
        return await self._execute("outbox_reroute", scope or "", None, sql, old, new, scope)

    async def prune(self, older_than: timedelta | float, batch: int = 1000) -> int:
        """Delete up to ``batch`` sent messages sent more than ``older_than`` ago (small
        batches: call it again while it returns ``batch``). Pending and parked messages are
        never pruned."""
        sql = (
            # created_at first: sent after it, so older too; its block-range index skips the
            # recent part of the table (all of it, on a pass with nothing to prune)
            f"WITH doomed AS (SELECT id FROM {self.table} WHERE created_at < now() - $1::interval"
            " AND status = 'sent' AND sent_at < now() - $1::interval LIMIT $2)"
            f" DELETE FROM {self.table} t USING doomed WHERE t.id = doomed.id"
        )
        return await self._execute("outbox_prune", "", None, sql, seconds(older_than), batch)
