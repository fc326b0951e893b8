"""Commands on a redis-py asyncio client's own connections, without its per-command layers.

The one module that reaches past redis-py's public API (one private call, see
`_DIRECT_WRITE`), kept because the public path costs too much. Measured in one process,
alternating rounds of this module and of a version sending every command through
``execute_command`` and scripts through ``register_script``'s call (redis-py 8.1, CPython
3.11, CPU time per unit of work, medians of 10 rounds): Redis store reserve + complete at
concurrency 8, 302 against 595 µs (+97 %); cache, duplicates only at concurrency 1, 195 against
368 µs (+89 %); cache, 90 % duplicates at concurrency 8, 267 against 451 µs (+69 %). The
benchmarks ``redis_store.reserve_complete_per_s`` and ``cache.*.decisions_per_s`` are bound by
that CPU, so they would lose far more than the 15 % a private internal may save.

The Redis store and the cache send one or two commands per unit of work, and each goes through
redis-py: its own way, per command, takes a connection from the pool and gives it back and goes
through its retry and observability layers, which together cost more CPU than the round trip
itself. `Commands` keeps a few of the pool's connections between calls (up to
`MAX_IDLE`, about the peak of concurrent calls) and uses them directly: pack the command
(in C with hiredis, as redis-py's own synchronous client does), write, read the reply with the
connection's own parser. Still redis-py's connections, parser, TLS, ACL and timeouts; only the
wrapping is skipped.

A connection whose command failed or was interrupted (an error, a timeout, a cancelled caller)
is disconnected and given back to the pool: a reply may still be on its way. One that answered
with an error reply (``NOSCRIPT``, a script error) is intact and kept. A client without such a
pool (a cluster client) is used its own way.

Read timeouts: redis-py bounds each read by the connection's ``socket_timeout`` (5 s by
default) with its own ``asyncio.timeout``, one event-loop timer per command that is cancelled a
few hundred microseconds later; under load the loop's heap fills with cancelled timers, and the
two cost about 30 µs of CPU per unit of work (two commands), measured: a tenth of it. Here the
same bound is kept by `_Deadlines`: one timer for all the calls in flight, set for the
earliest deadline among them, so it fires about once per ``socket_timeout`` under load, not
once per command. A call past its deadline is cancelled and raises redis-py's ``TimeoutError``,
as the read would have; the connection is dropped.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

#: connections kept between calls, at most: the peak of concurrent calls, usually
MAX_IDLE = 16

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    import hiredis

    _hiredis_pack = hiredis.pack_command
except ImportError:  # the redis extra brings hiredis; without it, redis-py packs
    _hiredis_pack = None

#: Before Python 3.12 redis-py puts each write under ``asyncio.wait_for``, which creates a task
#: per command (a third of a command's cost). A command of a few hundred bytes only fills the
#: socket's buffer and the reply is read under the connection's timeout, so a connected
#: connection is written directly (its ``_send_packed_command``, there since redis-py 4.2).
_DIRECT_WRITE = sys.version_info < (3, 12)


async def _send(conn: Any, packed: list[bytes]) -> None:
    """Send a packed command on a redis-py asyncio connection (see `_DIRECT_WRITE`)."""
    if _DIRECT_WRITE and conn.is_connected:
        await conn._send_packed_command(packed)
    else:
        await conn.send_packed_command(packed, check_health=False)


class _Deadlines:
    """The read deadlines of the calls in flight, kept by one event-loop timer (see the module
    docstring). A call registers its task before it reads and leaves after; when the timer
    fires it cancels the tasks past their deadline and is set again for the earliest left."""

    def __init__(self) -> None:
        self._due: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def enter(self, task: asyncio.Task[Any], seconds: float) -> None:
        loop = task.get_loop()
        due = loop.time() + seconds
        self._due[task] = due
        # rare: calls usually share one timeout, so a later call's deadline is the later one
        if due < self._timer_at or loop is not self._timer_loop:
            self._arm(loop, due)

    def leave(self, task: asyncio.Task[Any]) -> bool:
        """Forget ``task``'s call; True when the timer cancelled it for being late."""
        self._due.pop(task, None)
        if self._expired and task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._fire, loop), at
        self._timer_loop = loop

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, math.inf
        now = loop.time()
        for task, due in list(self._due.items()):
            if task.done() or task.get_loop() is not loop:  # left behind by a closed loop
                del self._due[task]
            elif due <= now:
                del self._due[task]
                self._expired.add(task)
                task.cancel()
        if self._due:
            self._arm(loop, min(self._due.values()))


class Commands:
    """Send commands and scripts through ``redis`` (a ``redis.asyncio`` client), directly on
    its pool's connections where it has a pool (see the module docstring)."""

    def __init__(self, redis: Any) -> None:
        # the client's own package, installed since here is its client; imported only now, so
        # that importing the Postgres store (which may front a cache) never needs redis
        errors = importlib.import_module("redis.exceptions")
        self.redis = redis
        self._no_script: type[Exception] = errors.NoScriptError
        self._error_reply: type[Exception] = errors.ResponseError
        pool = getattr(redis, "connection_pool", None)
        self._pool: Any = pool if hasattr(pool, "get_connection") else None
        self._idle: list[Any] = []
        # redis-py before 6.0 wants a command name here (later ones warn when given one)
        self._get_args: tuple[str, ...] = ()
        if self._pool is not None:
            wanted = inspect.signature(self._pool.get_connection).parameters.get("command_name")
            if wanted is not None and wanted.default is inspect.Parameter.empty:
                self._get_args = ("EVALSHA",)
        # hiredis packs byte for byte as the connection's own packer does with its default
        # encoding, in a sixth of the time; another encoding keeps the connection's packer
        options = getattr(pool, "connection_kwargs", None) or {}
        utf8 = str(options.get("encoding", "utf-8")).lower().replace("_", "-") in ("utf-8", "utf8")
        strict = options.get("encoding_errors", "strict") == "strict"
        self._pack = _hiredis_pack if utf8 and strict else None
        self._timeout_error: type[Exception] = errors.TimeoutError
        self._deadlines = _Deadlines()

    async def call(self, *args: Any) -> Any:
        """One command (``"MGET", "a", "b"``): its reply, or the error redis-py raises."""
        if self._pool is None:
            return await self.redis.execute_command(*args)
        idle = self._idle
        conn = idle.pop() if idle else await self._pool.get_connection(*self._get_args)
        timeout = conn.socket_timeout
        task = asyncio.current_task() if timeout is not None else None
        try:
            packed = [self._pack(args)] if self._pack is not None else conn.pack_command(*args)
            await _send(conn, packed)
            if task is None:
                reply = await conn.read_response()
            else:
                # the deadline is kept here (see the module docstring): no timer of redis-py's
                cancelling = task.cancelling()
                self._deadlines.enter(task, timeout)
                try:
                    reply = await conn.read_response(timeout=math.inf)
                except asyncio.CancelledError as exc:
                    # late: the cancellation is the timer's, unless the caller's came too
                    if self._deadlines.leave(task) and task.uncancel() <= cancelling:
                        raise self._timeout_error(
                            f"Timeout reading from redis after {timeout} s"
                        ) from exc
                    raise
                finally:
                    if self._deadlines.leave(task):  # cancelled, but it never surfaced
                        task.uncancel()
        except self._error_reply:
            await self._keep(conn)  # a whole error reply was read: the connection is in step
            raise
        except BaseException:
            try:
                await conn.disconnect(nowait=True)  # a reply may still be on its way
            finally:
                await self._pool.release(conn)
            raise
        await self._keep(conn)
        return reply

    async def evalsha(self, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        """Run ``script`` (from ``redis.register_script``): ``EVALSHA``, or ``EVAL`` when the
        server has lost its scripts (a restart, ``SCRIPT FLUSH``)."""
        if self._pool is None:
            return await script(keys=keys, args=list(args))
        try:
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except self._no_script:
            return await self.call(b"EVAL", script.script, len(keys), *keys, *args)

    async def _keep(self, conn: Any) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            await self._pool.release(conn)
