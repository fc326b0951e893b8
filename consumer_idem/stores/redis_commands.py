"""Commands on a redis-py asyncio client's own connections, without its per-command layers.

The Redis store and the cache send one or two commands per unit of work, and each goes through
redis-py: its own way, per command, takes a connection from the pool and gives it back and goes
through its retry and observability layers, which together cost more CPU than the round trip
itself. :class:`Commands` keeps a few of the pool's connections between calls (up to
:data:`MAX_IDLE`, about the peak of concurrent calls) and uses them directly: pack the command
(in C with hiredis, as redis-py's own synchronous client does), write, read the reply with the
connection's own parser. Still redis-py's connections, parser, TLS, ACL and timeouts; only the
wrapping is skipped.

A connection whose command failed or was interrupted (an error, a timeout, a cancelled caller)
is disconnected and given back to the pool: a reply may still be on its way. One that answered
with an error reply (``NOSCRIPT``, a script error) is intact and kept. A client without such a
pool (a cluster client) is used its own way.
"""

from __future__ import annotations

import importlib
import inspect
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
    """Send a packed command on a redis-py asyncio connection (see :data:`_DIRECT_WRITE`)."""
    if _DIRECT_WRITE and conn.is_connected:
        await conn._send_packed_command(packed)
    else:
        await conn.send_packed_command(packed, check_health=False)


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

    async def call(self, *args: Any) -> Any:
        """One command (``"MGET", "a", "b"``): its reply, or the error redis-py raises."""
        if self._pool is None:
            return await self.redis.execute_command(*args)
        idle = self._idle
        conn = idle.pop() if idle else await self._pool.get_connection(*self._get_args)
        try:
            packed = [self._pack(args)] if self._pack is not None else conn.pack_command(*args)
            await _send(conn, packed)
            reply = await conn.read_response()
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
