"""A Redis store with the same state machine and decisions as
[`PostgresStore`][consumer_idem.PostgresStore].

For scopes whose effects do not live in Postgres and that accept Redis durability. Every
transition is one Lua script (atomic on the server), lease times come from the Redis server's
clock, and every owner write is conditional on the owner token, exactly as in Postgres.

What it does **not** guarantee (see the README): no transaction with the handler's database
writes (so no transactional mode and no ``local_writes``), and records are lost if Redis
restarts without persistence (AOF ``appendfsync always`` narrows that window; a replica does
not close it). Completed and failed records expire by TTL (retention); ``in_progress`` and
``unknown`` records never expire on their own: an unknown case must not silently disappear.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from consumer_idem.errors import KeyHeld, LeaseLost, NotUnknown, StoreUnavailable
from consumer_idem.metrics import Metrics
from consumer_idem.stores.base import (
    DEFAULT_LEASE,
    Retention,
    StoreBase,
    checked_duration,
)
from consumer_idem.stores.redis_compat import Commands
from consumer_idem.stores.results import encode_result
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Executed,
    Record,
    Resolution,
    ResultKind,
    Status,
    StoredResponse,
)

log = logging.getLogger("consumer_idem.stores.redis")
T = TypeVar("T")

# Shared Lua prologue: server time in ms, and the record as a table.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function load(k)
  local flat = redis.call('HGETALL', k)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h, #flat, flat
end
"""

_RESERVE = (
    _NOW
    + """
local fp, tok, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local h, n, flat = load(KEYS[1])
if n == 0 or h.st == 'expired' then
  -- a new record, without the fields every reader defaults (updated = created, no
  -- reconciliation attempts; 'att' stays: earlier versions' completion reads it), and no
  -- DEL when there was no record: each call costs the server, once per first execution
  if n > 0 then redis.call('DEL', KEYS[1]) end
  redis.call('HSET', KEYS[1], 'fp', fp, 'st', 'in_progress', 'tok', tok, 'lu', now + lease,
             'att', 1, 'ca', now, 'ret', ARGV[4])
  return now  -- a fresh claim: the caller knows every other field
end
-- a record left as it was is sent back as read (no second HGETALL)
if h.fp ~= fp then return {'misuse', 0, now, unpack(flat)} end
if h.st == 'completed' then return {'replay', 0, now, unpack(flat)} end
if h.st == 'unknown' then return {'unknown', 0, now, unpack(flat)} end
if h.st == 'failed_retryable' then
  redis.call('HSET', KEYS[1], 'st', 'in_progress', 'tok', tok, 'lu', now + lease,
             'att', (tonumber(h.att) or 1) + 1, 'ua', now)
  redis.call('PERSIST', KEYS[1])
  return {'execute', 0, now, unpack(redis.call('HGETALL', KEYS[1]))}
end
if tonumber(h.lu) < now then
  -- the owner vanished mid-flight: it may have acted, so never re-run; park it
  redis.call('HSET', KEYS[1], 'st', 'unknown', 'err', 'lease_expired', 'ra', now, 'ua', now)
  redis.call('HDEL', KEYS[1], 'tok', 'lu', 'rp')
  return {'unknown', 1, now, unpack(redis.call('HGETALL', KEYS[1]))}
end
return {'in_progress', 0, now, unpack(flat)}
"""
)

# ARGV: token, new status, then field/value pairs. Completed and failed records get their TTL;
# unknown ones never expire by themselves.
_OWNER = (
    _NOW
    + """
local h, n = load(KEYS[1])
if n == 0 or h.st ~= 'in_progress' or h.tok ~= ARGV[1] then return false end
local status = ARGV[2]
redis.call('HSET', KEYS[1], 'st', status, 'ua', now)
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('HDEL', KEYS[1], 'tok', 'lu')
if status == 'completed' then redis.call('HSET', KEYS[1], 'co', now) end
if status == 'unknown' then
  redis.call('HSET', KEYS[1], 'ra', now); redis.call('HDEL', KEYS[1], 'rp')
  redis.call('PERSIST', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], tonumber(redis.call('HGET', KEYS[1], 'ret')))
end
return {now, unpack(redis.call('HGETALL', KEYS[1]))}
"""
)

# Completion by the owner. ARGV: token, result JSON ('' for none), result kind, ttl ms, then,
# only with a stored HTTP response, its status, headers and body. Answers the server time and
# the fields the caller does not know (fingerprint, attempts, created at, the reconciliation
# bookkeeping), or false: not the owner. One HSET and one HDEL per case: each call costs the
# server, and this runs once per first execution.
_COMPLETE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HMGET', KEYS[1], 'st', 'tok', 'fp', 'att', 'ca', 'rat', 'rp')
if v[1] ~= 'in_progress' or v[2] ~= ARGV[1] then return false end
if #ARGV < 5 then
  if ARGV[2] == '' then
    redis.call('HSET', KEYS[1], 'st', 'completed', 'ua', now, 'co', now, 'rk', ARGV[3],
               'ret', ARGV[4])
    redis.call('HDEL', KEYS[1], 'tok', 'lu', 'err', 'res', 'hs', 'hh', 'hb')
  else
    redis.call('HSET', KEYS[1], 'st', 'completed', 'ua', now, 'co', now, 'rk', ARGV[3],
               'ret', ARGV[4], 'res', ARGV[2])
    redis.call('HDEL', KEYS[1], 'tok', 'lu', 'err', 'hs', 'hh', 'hb')
  end
elseif ARGV[2] == '' then
  redis.call('HSET', KEYS[1], 'st', 'completed', 'ua', now, 'co', now, 'rk', ARGV[3],
             'ret', ARGV[4], 'hs', ARGV[5], 'hh', ARGV[6], 'hb', ARGV[7])
  redis.call('HDEL', KEYS[1], 'tok', 'lu', 'err', 'res')
else
  redis.call('HSET', KEYS[1], 'st', 'completed', 'ua', now, 'co', now, 'rk', ARGV[3],
             'ret', ARGV[4], 'res', ARGV[2], 'hs', ARGV[5], 'hh', ARGV[6], 'hb', ARGV[7])
  redis.call('HDEL', KEYS[1], 'tok', 'lu', 'err')
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {now, v[3], v[4] or 1, v[5], v[6] or 0, v[7] or ''}
"""

# ARGV: new status ('completed' | 'failed_retryable'), ttl ms, then field/value pairs.
_RESOLVE = (
    _NOW
    + """
local h, n = load(KEYS[1])
if n == 0 or h.st ~= 'unknown' then return false end
redis.call('HSET', KEYS[1], 'st', ARGV[1], 'ua', now)
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('HDEL', KEYS[1], 'ra')
if ARGV[1] == 'completed' then redis.call('HSET', KEYS[1], 'co', now, 'ret', ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return {now, unpack(redis.call('HGETALL', KEYS[1]))}
"""
)

#: an operator's evict (no token) of a key a worker holds answers minus its lease end (ms)
_EVICT = (
    _NOW
    + """
if ARGV[1] ~= '' then
  if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] then return 0 end
else
  local h, n = load(KEYS[1])
  if n > 0 and h.st == 'in_progress' and tonumber(h.lu) > now then return -tonumber(h.lu) end
end
return redis.call('DEL', KEYS[1])
"""
)

_SWEEP = (
    _NOW
    + """
local h, n = load(KEYS[1])
if n == 0 or h.st ~= 'in_progress' or tonumber(h.lu) >= now then return 0 end
redis.call('HSET', KEYS[1], 'st', 'unknown', 'err', 'lease_expired', 'ra', now, 'ua', now)
redis.call('HDEL', KEYS[1], 'tok', 'lu', 'rp')
return 1
"""
)


def _ms(value: Any) -> datetime | None:
    """`_at`, or None for a field the record does not have."""
    return _at(value) if value not in (None, "", b"") else None


def _record(scope: str, key: str, flat: list[Any]) -> Record:
    h = {_s(flat[i]): _s(flat[i + 1]) for i in range(0, len(flat), 2)}
    response = None
    if h.get("hs"):
        response = StoredResponse(
            int(h["hs"]), json.loads(h.get("hh") or "{}"), bytes.fromhex(h.get("hb") or "")
        )
    created = _ms(h.get("ca")) or datetime.now(UTC)
    ret = int(h.get("ret") or 0)
    return Record(
        scope=scope,
        key=key,
        fingerprint=h["fp"],
        status=Status(h["st"]),
        owner_token=uuid.UUID(h["tok"]) if h.get("tok") else None,
        locked_until=_ms(h.get("lu")),
        attempts=int(h.get("att") or 1),
        result_json=h.get("res"),
        result_kind=ResultKind(h["rk"]) if h.get("rk") else None,
        response=response,
        last_error=h.get("err"),
        reconcile_after=_ms(h.get("ra")),
        reconcile_attempts=int(h.get("rat") or 0),
        reconcile_published_at=_ms(h.get("rp")),
        created_at=created,
        updated_at=_ms(h.get("ua")) or created,
        completed_at=_ms(h.get("co")),
        expires_at=(_ms(h.get("ua")) or created) + timedelta(milliseconds=ret),
    )


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _at(ms: Any) -> datetime:
    """A server time in ms (an integer reply, or its digits as bytes or str) as a datetime."""
    return datetime.fromtimestamp(int(ms) / 1000, UTC)


def _whole_ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def _response_fields(response: StoredResponse | None) -> list[str]:
    if response is None:
        return ["hs", "", "hh", "", "hb", ""]
    return [
        "hs",
        str(response.status),
        "hh",
        json.dumps(dict(response.headers)),
        "hb",
        response.body.hex(),
    ]


class RedisStore(StoreBase):
    """Idempotency records in Redis (``redis.asyncio`` client), one hash per (scope, key)."""

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "consumer-idem:",
        lease: timedelta | float = DEFAULT_LEASE,
        retention: Retention = None,
        metrics: Metrics | None = None,
        hash_invalid_keys: bool = False,
    ) -> None:
        super().__init__(
            lease=lease, retention=retention, metrics=metrics, hash_invalid_keys=hash_invalid_keys
        )
        self.redis = redis
        self.prefix = prefix
        # reserve and complete go to the server directly: see redis_compat
        self._commands = Commands(redis)
        self._reserve = redis.register_script(_RESERVE)
        self._owner = redis.register_script(_OWNER)
        self._complete = redis.register_script(_COMPLETE)
        self._resolve = redis.register_script(_RESOLVE)
        self._evict = redis.register_script(_EVICT)
        self._sweep = redis.register_script(_SWEEP)

    def _key(self, scope: str, key: str) -> str:
        # \x1f cannot occur in a scope or key (key hygiene rejects control characters)
        return f"{self.prefix}{scope}\x1f{key}"

    async def _eval(
        self, operation: str, scope: str, script: Any, key: str, args: tuple[Any, ...]
    ) -> Any:
        """``script`` on ``key``: one command, one round trip (see
        `redis_compat`), through `_run`."""
        return await self._run(
            operation, scope, lambda: self._commands.evalsha(script, [key], args)
        )

    async def _run(self, operation: str, scope: str, call: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        try:
            return await call()
        except Exception as exc:  # any Redis failure means: do not proceed
            self.metrics.inc("store_error", scope)
            raise StoreUnavailable(
                f"redis store {operation} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.metrics.observe(operation, time.perf_counter() - started)

    async def migrate(self) -> list[int]:
        """Nothing to migrate: records are hashes. Present for symmetry with PostgresStore."""
        return []

    async def reserve(
        self,
        scope: str,
        key: str | bytes,
        fingerprint: str,
        *,
        lease: timedelta | float | None = None,
        retention: timedelta | float | None = None,
        conn: Any = None,
    ) -> Decision:
        if conn is not None:
            raise TypeError("the Redis store cannot join a database transaction")
        scope, key = self.check(scope, key)
        lease_ms = _whole_ms(self.lease if lease is None else checked_duration(lease, "lease"))
        ret_ms = _whole_ms(self.retention_for(scope, retention))
        owner = uuid.uuid4()
        out = await self._eval(
            "reserve",
            scope,
            self._reserve,
            self._key(scope, key),
            (fingerprint, str(owner), lease_ms, ret_ms),
        )
        if type(out) is int:  # a fresh claim: the server time alone came back
            now = out
            created = _at(now)
            decision = Decision(
                DecisionKind.EXECUTE,
                Record(
                    scope=scope,
                    key=key,
                    fingerprint=fingerprint,
                    status=Status.IN_PROGRESS,
                    owner_token=owner,
                    locked_until=_at(now + lease_ms),
                    attempts=1,
                    result_json=None,
                    result_kind=None,
                    response=None,
                    last_error=None,
                    reconcile_after=None,
                    reconcile_attempts=0,
                    reconcile_published_at=None,
                    created_at=created,
                    updated_at=created,
                    completed_at=None,
                    expires_at=_at(now + ret_ms),
                ),
                False,
            )
        else:
            kind = DecisionKind(_s(out[0]))
            decision = Decision(kind, _record(scope, key, out[3:]), bool(int(out[1])))
        self.count_decision(decision, scope)
        return decision

    async def _owner_write(
        self,
        operation: str,
        scope: str,
        key: str,
        token: uuid.UUID,
        status: str,
        fields: list[str],
    ) -> Record:
        out = await self._run(
            operation,
            scope,
            lambda: self._owner(keys=[self._key(scope, key)], args=[str(token), status, *fields]),
        )
        if not out:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"{operation}: ({scope!r}, {key!r}) is no longer held by this owner")
        return _record(scope, key, out[1:])

    async def complete(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        response: StoredResponse | None = None,
        retention: timedelta | float | None = None,
        conn: Any = None,
    ) -> Record:
        if conn is not None:
            raise TypeError("the Redis store cannot join a database transaction")
        ret_ms = _whole_ms(self.retention_for(scope, retention))
        encoded = encode_result(result)
        args: tuple[Any, ...] = (str(token), encoded or "", result_kind.value, ret_ms)
        if response is not None:
            args += tuple(_response_fields(response)[1::2])
        out = await self._eval("complete", scope, self._complete, self._key(scope, key), args)
        if not out:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"complete: ({scope!r}, {key!r}) is no longer held by this owner")
        # the script answers what only the record knows; the rest is what was just written
        now, fingerprint, attempts, created, reconciled, published = out
        done = _at(now)
        return Record(
            scope=scope,
            key=key,
            fingerprint=_s(fingerprint),
            status=Status.COMPLETED,
            owner_token=None,
            locked_until=None,
            attempts=int(attempts or 1),
            result_json=encoded,
            result_kind=result_kind,
            response=response,
            last_error=None,
            reconcile_after=None,
            reconcile_attempts=int(reconciled or 0),
            reconcile_published_at=_ms(published),
            created_at=_ms(created) or done,
            updated_at=done,
            completed_at=done,
            expires_at=_at(int(now) + ret_ms),
        )

    async def fail_retryable(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        error: str = "retryable",
        *,
        conn: Any = None,
    ) -> Record:
        record = await self._owner_write(
            "fail_retryable", scope, key, token, "failed_retryable", ["err", error]
        )
        self.metrics.inc("failed_retry", scope)
        return record

    async def mark_unknown(
        self,
        scope: str,
        key: str,
        token: uuid.UUID,
        error: str = "ambiguous",
        *,
        conn: Any = None,
    ) -> Record:
        record = await self._owner_write(
            "mark_unknown", scope, key, token, "unknown", ["err", error]
        )
        self.metrics.inc("unknown", scope)
        return record

    async def resolve(
        self,
        scope: str,
        key: str,
        resolution: Resolution,
        *,
        retention: timedelta | float | None = None,
        conn: Any = None,
    ) -> Record:
        ret_ms = int(self.retention_for(scope, retention).total_seconds() * 1000)
        if isinstance(resolution, Executed):
            status = "completed"
            fields = [
                "res",
                encode_result(resolution.result) or "",
                "rk",
                resolution.result_kind.value,
                *_response_fields(resolution.response),
            ]
        else:
            status, fields = "failed_retryable", ["err", resolution.reason]
        out = await self._run(
            "resolve",
            scope,
            lambda: self._resolve(keys=[self._key(scope, key)], args=[status, ret_ms, *fields]),
        )
        if not out:
            raise NotUnknown(f"({scope!r}, {key!r}) is not unknown; nothing to resolve")
        self.metrics.inc("reconcile_resolved", scope)
        return _record(scope, key, out[1:])

    async def get(self, scope: str, key: str) -> Record | None:
        flat = await self._run("get", scope, lambda: self.redis.hgetall(self._key(scope, key)))
        if not flat:
            return None
        pairs = [x for kv in flat.items() for x in kv]
        return _record(scope, key, pairs)

    async def evict(self, scope: str, key: str, *, token: uuid.UUID | None = None) -> bool:
        """Delete a record. With ``token``, only while that owner still holds it; without, as
        an operator: False when there is no record, [`KeyHeld`][consumer_idem.KeyHeld] when a worker
        holds it
        (nothing evicted). The Redis store keeps no original messages (reconciliation is
        Postgres-only): an ``unknown`` key whose delivery was acked has no copy here to send."""
        deleted = await self._run(
            "evict",
            scope,
            lambda: self._evict(
                keys=[self._key(scope, key)], args=["" if token is None else str(token)]
            ),
        )
        if token is not None and not deleted:
            self.metrics.inc("lease_lost", scope)
            raise LeaseLost(f"evict: ({scope!r}, {key!r}) is no longer held by this owner")
        if int(deleted) < 0:  # a worker holds it: deleted under its call, a duplicate reruns it
            raise KeyHeld(scope, key, _at(-int(deleted)))
        return bool(deleted)

    async def sweep(self, *, batch_size: int = 500) -> int:
        """Park expired leases as ``unknown``. Scans the store's keys (O(records)): run it
        from one place, not per request."""
        parked: Counter[str] = Counter()

        async def scan() -> None:
            async for raw in self.redis.scan_iter(match=f"{self.prefix}*", count=batch_size):
                name = _s(raw)
                if await self._sweep(keys=[name], args=[]):
                    parked[name[len(self.prefix) :].split("\x1f", 1)[0]] += 1

        await self._run("sweep", "", scan)
        for scope, n in parked.items():
            self.metrics.inc("zombie", scope, n)
            self.metrics.inc("unknown", scope, n)
        return sum(parked.values())

    async def prune(self, **_: Any) -> int:
        """Nothing to do: completed and failed records expire by TTL in Redis itself."""
        return 0
