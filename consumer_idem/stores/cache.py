"""A Redis cache of completed records in front of the Postgres store.

A duplicate of completed work is answered from Redis without a Postgres round trip. Postgres
stays the authority: only ``completed`` records are ever cached, only after their Postgres
commit (or when Postgres itself answers a replay); a miss, an error or a Redis outage falls
through to Postgres (and a short circuit breaker stops asking Redis for a few seconds, so an
outage costs no latency); ``evict`` and ``prune`` remove entries. A completed record never
changes in Postgres except by deletion or expiry, which is why serving it from a cache is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from consumer_idem.metrics import Metrics
from consumer_idem.types import Record, ResultKind, Status, StoredResponse

if TYPE_CHECKING:
    from consumer_idem.stores.resp import RespConnection

log = logging.getLogger("consumer_idem.stores.cache")


class CompletedCache:
    """``redis``: a ``redis.asyncio`` client. Every call is bounded, by the client's
    ``socket_timeout`` or else by ``timeout`` seconds here: a slow Redis counts as an outage
    and falls through to Postgres.

    With ``fast_path`` (the default) the cache sends its four commands over a pipelined
    connection of its own (:mod:`consumer_idem.stores.resp`) opened with the client's address,
    db and credentials, because redis-py's per-command overhead is most of a cached duplicate's
    cost; a client that needs more (TLS, a credential provider, Sentinel, Cluster) is used as it is.
    Call :meth:`aclose` when done with the cache; the client stays yours to close."""

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "consumer-idem:completed:",
        ttl: timedelta | float = timedelta(hours=1),
        timeout: float = 0.25,
        breaker_seconds: float = 5.0,
        metrics: Metrics | None = None,
        fast_path: bool = True,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
        self.timeout = timeout
        self.breaker_seconds = breaker_seconds
        self.metrics = metrics or Metrics()
        self._open_until = 0.0
        # lookups waiting for the round trip in flight, then sent together as one MGET
        self._gathering: list[tuple[str, asyncio.Future[Any] | None]] | None = None
        self._in_flight = False
        self._flight_done: asyncio.Future[None] | None = None  # made only when awaited
        # the client's own socket timeout already bounds each read: no second timer then
        pool_options = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
        client_timeout = pool_options.get("socket_timeout")
        self._client_bounded = bool(client_timeout)
        self._fast: RespConnection | None = None
        if fast_path:  # imported here: the store must not need hiredis without a cache
            from consumer_idem.stores.resp import RespConnection, endpoint_of

            endpoint = endpoint_of(redis)
            if endpoint is not None:
                self._fast = RespConnection(endpoint, timeout=float(client_timeout or timeout))

    async def aclose(self) -> None:
        """Close the cache's own connection (the redis-py client is left open)."""
        if self._fast is not None:
            await self._fast.aclose()

    def _key(self, scope: str, key: str) -> str:
        return f"{self.prefix}{scope}\x1f{key}"  # \x1f cannot occur in a scope or key

    def _available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _failed(self, operation: str, exc: Exception) -> None:
        self.metrics.inc("cache_error", "")
        was_open = not self._available()
        self._open_until = time.monotonic() + self.breaker_seconds
        if was_open:  # the lookups of one failed MGET: say it once
            return
        log.warning(
            "cache %s failed, using Postgres only for %.0fs: %r",
            operation,
            self.breaker_seconds,
            exc,
        )

    async def get(self, scope: str, key: str) -> Record | None:
        if not self._available():
            return None
        try:
            raw = await self._lookup(self._key(scope, key))
        except Exception as exc:
            self._failed("get", exc)
            return None
        if raw is None:
            self.metrics.inc("cache_miss", scope)
            return None
        try:
            record = _decode(scope, key, raw)
        except (ValueError, KeyError, TypeError) as exc:  # not ours, or not this key's: a miss
            self.metrics.inc("cache_error", scope)
            log.warning("cache entry for %r/%r ignored: %r", scope, key, exc)
            return None
        self.metrics.inc("cache_hit", scope)
        return record

    async def _lookup(self, name: str) -> Any:
        """GET, batched under concurrency: while one round trip is in flight, the lookups that
        arrive (a consumer's prefetch, an HTTP server) gather and then share one MGET. The
        client's cost per command, not Redis, is most of what a cached duplicate pays for. A
        lone lookup goes at once, with no added wait."""
        batch = self._gathering
        if batch is not None:  # a batch is gathering: ride along
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            batch.append((name, future))
            return await future
        if not self._in_flight:
            return (await self._send([name]))[0]
        batch = self._gathering = [(name, None)]  # lead the next batch
        if self._flight_done is None:
            self._flight_done = asyncio.get_running_loop().create_future()
        try:
            await self._flight_done  # resolved (never failed) when that round trip ends
        except BaseException:
            self._settle_waiting(batch, None)  # cancelled: the others ask Postgres
            raise
        finally:
            self._gathering = None
        names = list(dict.fromkeys(n for n, _ in batch))
        try:
            values = await self._send(names)
        except BaseException as exc:
            self._settle_waiting(batch, exc if isinstance(exc, Exception) else None)
            raise
        found = dict(zip(names, values, strict=True))
        for other, waiting in batch[1:]:
            if waiting is not None and not waiting.done():
                waiting.set_result(found[other])
        return found[name]

    async def _send(self, names: list[str]) -> list[Any]:
        self._in_flight = True
        try:
            if len(names) == 1:
                return [await self._command("GET", names[0])]
            return list(await self._command("MGET", *names))
        finally:
            self._in_flight = False
            done, self._flight_done = self._flight_done, None
            if done is not None:
                done.set_result(None)

    async def _command(self, *args: str | int) -> Any:
        """One bounded command: on the cache's own connection (which bounds it), else through
        redis-py with a timer of ``timeout`` seconds unless the client bounds its reads itself."""
        if self._fast is not None:
            return await self._fast.execute(*args)
        timer = contextlib.nullcontext() if self._client_bounded else asyncio.timeout(self.timeout)
        async with timer:
            return await self.redis.execute_command(*args)

    @staticmethod
    def _settle_waiting(
        batch: list[tuple[str, asyncio.Future[Any] | None]], error: Exception | None
    ) -> None:
        for _, waiting in batch[1:]:
            if waiting is not None and not waiting.done():
                if error is None:
                    waiting.set_result(None)  # a miss: Postgres decides
                else:
                    waiting.set_exception(error)

    async def put(self, record: Record) -> None:
        """Cache a completed record (anything else is ignored: only completed is safe)."""
        if record.status is not Status.COMPLETED or not self._available():
            return
        ttl = min(self.ttl, record.expires_at - datetime.now(UTC))
        if ttl.total_seconds() < 1:
            return
        name, value = self._key(record.scope, record.key), _encode(record)
        px = int(ttl / timedelta(milliseconds=1))
        try:
            await self._command("SET", name, value, "PX", px)
        except Exception as exc:
            self._failed("put", exc)

    async def delete(self, pairs: Iterable[tuple[str, str]]) -> None:
        keys = [self._key(scope, key) for scope, key in pairs]
        if not keys:
            return
        try:
            await self._command("DEL", *keys)
        except Exception as exc:  # a stale entry outlives this only until its TTL
            self._failed("delete", exc)


def _encode(record: Record) -> str:
    response = record.response
    return json.dumps(
        {
            "sk": [record.scope, record.key],
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


def _decode(scope: str, key: str, raw: bytes | str) -> Record:
    d = json.loads(raw)
    if d["sk"] != [scope, key]:  # the entry names its own key: a reply is never misattributed
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
