"""A Redis cache of completed records in front of the Postgres store, through redis-py.

A duplicate of completed work is answered from Redis without a Postgres round trip. Postgres
stays the authority: only ``completed`` records are ever cached, only after their Postgres
commit (or when Postgres itself answers a replay); a miss, an error or a Redis outage falls
through to Postgres (and a short circuit breaker stops asking Redis for a few seconds, so an
outage costs no latency). A completed record never changes in Postgres except by deletion
(``evict``) or expiry (``prune``), which is why serving it from a cache is safe.

Three rules keep it so:

* **Keys name their store.** An entry's key holds the store's database and schema besides the
  scope and key, so stores that share one Redis never answer each other's keys.
* **An evict is final.** A lookup reads the key's *fence* together with the entry (one ``MGET``);
  a miss leaves the caller a ticket with the fence it saw. ``evict`` replaces the fence with a
  fresh random token and deletes the entry, in one script, after the row is gone from Postgres.
  A fill is a script that writes the entry only while the fence is still the one on the ticket,
  and the ticket was taken before the caller read Postgres. So a reader that read the row before
  the evict, however late its fill arrives, in this process or any other, cannot bring the entry
  back. A ticket lives in the caller's task (a context variable), never shared between callers.
* **A cancelled caller is not an outage.** Each lookup is its own command on its own connection
  (see `redis_compat`): cancelling one caller cancels only its
  command (that connection is dropped), never another caller's, and never opens the breaker,
  which only errors and timeouts do.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

from consumer_idem.metrics import Metrics
from consumer_idem.stores.redis_compat import Commands
from consumer_idem.types import Record, ResultKind, Status, StoredResponse

log = logging.getLogger("consumer_idem.stores.cache")

T = TypeVar("T")

#: KEYS: entry, fence. ARGV: the fence the caller saw ('' for none), the entry, its TTL in ms.
_FILL = """
if (redis.call('GET', KEYS[2]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
#: KEYS: entry, fence. ARGV: a fresh fence token, its TTL in ms.
_EVICT = """
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return redis.call('DEL', KEYS[1])
"""
#: A ticket older than this fills nothing (the fill is skipped, the next duplicate fills).
#: Fences outlive it tenfold, so a fence a ticket predates is still there when the ticket is used:
#: a fence that expired and came back as "none" could otherwise match an old ticket.
TICKET_SECONDS = 60.0
FENCE_MS = int(TICKET_SECONDS * 10 * 1000)
#: tickets kept per task: a task handles a few keys at a time (one delivery, one batch)
_TICKETS_KEPT = 32
#: after the store's identity could not be read, wait this long before asking Postgres again
_IDENTITY_RETRY_SECONDS = 1.0

#: per task: (entry name, the fence seen, when) for each recent miss, newest first
_tickets: ContextVar[tuple[tuple[str, Any, float], ...]] = ContextVar(
    "consumer_idem_cache_tickets", default=()
)


class CachedStore(Protocol):
    """What the cache needs from the store it fronts ([`PostgresStore`][consumer_idem.PostgresStore]
    is one)."""

    schema: str
    metrics: Metrics

    async def run(
        self, operation: str, scope: str, conn: Any, call: Callable[[Any], Awaitable[T]]
    ) -> T: ...


class CompletedCache:
    """``redis``: a ``redis.asyncio`` client. The cache sends plain commands and scripts only, and
    the two keys of a record share a Cluster hash tag. Give it a pooled client: concurrent
    lookups each take a connection. The client stays yours to close.

    Every call is bounded by ``timeout`` seconds (by the client's ``socket_timeout`` when that
    is as short, else by a timer of the cache's): a slow Redis counts as an outage and falls
    through to Postgres. A client made with ``socket_timeout=None`` spares the cache's timer
    when the cache's bound is the shorter (a client's socket timeout costs no timer per
    command: see `redis_compat`). Keys start with
    ``prefix``, then the store's database and schema (read once from Postgres, on first use),
    then scope and key. Entries live for ``min(ttl, the record's remaining retention)``.

    Hand the cache to one store (``PostgresStore(pool, cache=cache)``), which attaches it."""

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "consumer-idem:completed:",
        ttl: timedelta | float = timedelta(hours=1),
        timeout: float = 0.25,
        breaker_seconds: float = 5.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
        self.timeout = timeout
        self.breaker_seconds = breaker_seconds
        self.metrics = metrics or Metrics()
        self._open_until = 0.0
        # the client's own socket timeout, when it is as short, already bounds each call: no
        # second timer then
        client_timeout = _socket_timeout(redis)
        self._client_bounded = client_timeout is not None and 0 < client_timeout <= timeout
        self._fill = redis.register_script(_FILL)
        self._evict = redis.register_script(_EVICT)
        # lookups and fills, once per unit of work: on the client's connections, directly
        self._commands = Commands(redis)
        self._store: CachedStore | None = None
        self._space: str | None = None  # database and schema, once read
        self._space_lock = asyncio.Lock()
        self._space_retry_at = 0.0

    def attach(self, store: CachedStore) -> None:
        """Front ``store`` (its constructor calls this): count in its metrics, and key entries
        by its database and schema. One cache fronts one store."""
        if self._store is not None and self._store is not store:
            raise ValueError("this CompletedCache already fronts another store: give each its own")
        self._store = store
        self.metrics = store.metrics

    # --- names -----------------------------------------------------------------------------------

    async def _namespace(self, *, retry_now: bool = False) -> str | None:
        """``database\\x1fschema`` of the store, or None while Postgres cannot say (the cache
        then stands aside: lookups miss, fills and evict fences are skipped)."""
        if self._space is not None:
            return self._space
        store = self._store
        if store is None:
            raise RuntimeError("a CompletedCache is used through its store: PostgresStore(cache=)")
        async with self._space_lock:  # one query for the callers waiting on the first use
            if self._space is None and (retry_now or time.monotonic() >= self._space_retry_at):
                try:
                    async with asyncio.timeout(max(self.timeout * 4, 1.0)):
                        database = await store.run(
                            "cache_identity",
                            "",
                            None,
                            lambda c: c.fetchval("SELECT current_database()"),
                        )
                except Exception:  # already logged by the store; a cancellation propagates
                    self._space_retry_at = time.monotonic() + _IDENTITY_RETRY_SECONDS
                else:
                    self._space = f"{database}\x1f{store.schema}"
        return self._space

    def _names(self, space: str, scope: str, key: str) -> tuple[str, str]:
        """The entry and its fence. The braces are a Cluster hash tag: both land on one slot, so
        one MGET or script reaches both. ``\\x1f`` occurs in no schema, scope or key."""
        tagged = f"{self.prefix}{{{space}\x1f{scope}\x1f{key}}}"
        return tagged, tagged + ":fence"

    # --- health ----------------------------------------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _failed(self, operation: str, exc: Exception) -> None:
        self.metrics.inc("cache_error", "")
        was_open = not self._available()
        self._open_until = time.monotonic() + self.breaker_seconds
        if not was_open:
            log.warning(
                "cache %s failed, using Postgres only for %.0fs: %r",
                operation,
                self.breaker_seconds,
                exc,
            )

    async def _bounded(self, call: Awaitable[T]) -> T:
        """``call`` bounded by ``timeout`` unless the client's socket timeout bounds it."""
        timer = contextlib.nullcontext() if self._client_bounded else asyncio.timeout(self.timeout)
        async with timer:
            return await call

    # --- the three operations ------------------------------------------------------------------

    async def get(self, scope: str, key: str) -> Record | None:
        """The cached completed record of ``(scope, key)``, or None (ask Postgres). A miss leaves
        this task a ticket, which lets a `put` of this key after the Postgres read fill."""
        if not self._available():
            return None
        space = self._space or await self._namespace()
        if space is None:
            return None
        entry, fence = self._names(space, scope, key)
        try:
            raw, seen = await self._bounded(self._commands.call("MGET", entry, fence))
        except Exception as exc:  # a cancelled caller raises CancelledError: not an outage
            self._failed("get", exc)
            return None
        if raw is not None:
            try:
                record = _decode(space, scope, key, raw)
            except (ValueError, KeyError, TypeError) as exc:  # not ours, or not this key's: a miss
                self.metrics.inc("cache_error", scope)
                log.warning("cache entry for %r/%r ignored: %r", scope, key, exc)
            else:
                self.metrics.inc("cache_hit", scope)
                return record
        self.metrics.inc("cache_miss", scope)
        now, tickets = time.monotonic(), _tickets.get()
        # a live ticket of this key stays: the oldest fence is the one that predates every
        # Postgres read this task made since, whichever of them a later put carries
        if not any(t[0] == entry and now - t[2] <= TICKET_SECONDS for t in tickets):
            kept = tuple(t for t in tickets if t[0] != entry)[: _TICKETS_KEPT - 1]
            _tickets.set(((entry, b"" if seen is None else seen, now), *kept))
        return None

    async def put(self, record: Record) -> None:
        """Cache a completed record (anything else is ignored: only completed is safe) that this
        task read from or wrote to Postgres after its `get` of the key missed. It fills
        only if that miss is less than `TICKET_SECONDS` old and no evict of the key has
        happened since; the miss's ticket is then used up."""
        if record.status is not Status.COMPLETED or not self._available():
            return
        ttl = min(self.ttl, record.expires_at - datetime.now(UTC))
        if ttl.total_seconds() < 1:
            return
        space = self._space or await self._namespace()
        if space is None:
            return
        entry, fence = self._names(space, record.scope, record.key)
        tickets = _tickets.get()
        seen = next((t for t in tickets if t[0] == entry), None)
        if seen is None or time.monotonic() - seen[2] > TICKET_SECONDS:
            # no lookup before the Postgres read, in this task: an evict may have come between
            self.metrics.inc("cache_fill_skipped", record.scope)
            return
        _tickets.set(tuple(t for t in tickets if t[0] != entry))
        px = int(ttl / timedelta(milliseconds=1))
        value = _encode(space, record)
        try:
            filled = await self._bounded(
                self._commands.evalsha(self._fill, [entry, fence], (seen[1], value, px))
            )
        except Exception as exc:
            self._failed("put", exc)
            return
        if not filled:  # an evict came after this task's lookup: the record may be gone
            self.metrics.inc("cache_fill_fenced", record.scope)

    async def delete(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Evict: delete the entries and fence them, so that no fill from a Postgres read made
        before this call lands after it. Call it once the rows are gone (``evict`` does)."""
        pairs = list(pairs)
        space = await self._namespace(retry_now=True) if pairs else None
        if space is None:
            if pairs:
                log.warning(
                    "cache evict of %d key(s) skipped: the store's identity is unknown", len(pairs)
                )
            return
        token = secrets.token_hex(8)  # never a fence seen before, so no old ticket matches it
        try:
            for scope, key in pairs:  # evict passes one; prune uses drop_expired
                names = self._names(space, scope, key)
                await self._bounded(self._evict(keys=names, args=[token, FENCE_MS]))
        except Exception as exc:  # a stale entry outlives this only until its TTL
            self._failed("delete", exc)

    async def drop_expired(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Delete the entries of expired records (``prune``). No fence: a fill of an expired
        record is refused by its own TTL (its retention has run out)."""
        space = await self._namespace()
        if space is None:
            return
        names = [self._names(space, scope, key)[0] for scope, key in pairs]
        if not names:
            return
        try:
            await self._bounded(self.redis.delete(*names))
        except Exception as exc:  # a stale entry outlives this only until its TTL
            self._failed("delete", exc)


def _socket_timeout(redis: Any) -> float | None:
    """The socket timeout the client's connections use: the one it was given, else the
    connection class's default (redis-py 8 gives every connection 5 s unless told otherwise)."""
    pool: Any = getattr(redis, "connection_pool", None)
    options = getattr(pool, "connection_kwargs", None) or {}
    value = options.get("socket_timeout")
    if "socket_timeout" not in options:
        # the default is a parameter of a base class's __init__ (a subclass passes **kwargs on)
        for cls in getattr(getattr(pool, "connection_class", None), "__mro__", ()):
            init = cls.__dict__.get("__init__")
            try:
                param = inspect.signature(init).parameters.get("socket_timeout")
            except (TypeError, ValueError):
                continue
            if param is not None:
                value = param.default
                break
    return float(value) if isinstance(value, int | float) else None


def _encode(space: str, record: Record) -> str:
    response = record.response
    return json.dumps(
        {
            "sk": [space, record.scope, record.key],
            "fp": record.fingerprint,
            "res": record.result_json,
            "rk": record.result_kind.value if record.result_kind else None,
            "att": record.attempts,
            "hs": response.status if response else None,
            "hh": dict(response.headers) if response else None,
            "hb": response.body.hex() if response else None,
            "ca": record.created_at.isoformat(),
            "co": record.completed_at.isoformat() if record.completed_at else None,
            "ex": record.expires_at.isoformat(),
        },
        separators=(",", ":"),
    )


def _decode(space: str, scope: str, key: str, raw: bytes | str) -> Record:
    d = json.loads(raw)
    if d["sk"] != [space, scope, key]:  # the entry names its own store and key
        raise ValueError(f"entry is for {d['sk']!r}")
    created = datetime.fromisoformat(d["ca"])
    response = (
        StoredResponse(d["hs"], d["hh"] or {}, bytes.fromhex(d["hb"] or ""))
        if d["hs"] is not None
        else None
    )
    return Record(
        scope=scope,
        key=key,
        fingerprint=d["fp"],
        status=Status.COMPLETED,
        owner_token=None,
        locked_until=None,
        attempts=d["att"],
        result_json=d["res"],
        result_kind=ResultKind(d["rk"]) if d["rk"] else None,
        response=response,
        last_error=None,
        reconcile_after=None,
        reconcile_attempts=0,
        reconcile_published_at=None,
        created_at=created,
        updated_at=datetime.fromisoformat(d["co"]) if d["co"] else created,
        completed_at=datetime.fromisoformat(d["co"]) if d["co"] else None,
        expires_at=datetime.fromisoformat(d["ex"]),
    )
