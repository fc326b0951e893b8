"""The outbox relay of a FastStream app: started and stopped with the app, or with the broker.

What a handler publishes through ``IdempotentOutbox`` goes out through the broker right after
its COMMIT; what a crash or an outage left behind is sent by a relay. An
[`Idempotency`][consumer_idem.faststream.relay.Idempotency]
middleware runs one for its scope (``outbox_relay`` seconds between passes; None: none):

* given the app (``Idempotency(..., app=app)``): it starts once the app has started its broker
  (``after_startup``), so messages a crash left are sent even if no new message ever comes,
  and stops before the app stops its broker (``on_shutdown``);
* otherwise it starts with the first delivery the middleware sees (the broker is running
  then), and stops once the broker stops. Call
  [`OutboxRelayTask.start`][consumer_idem.faststream.relay.OutboxRelayTask.start] yourself where
  your app starts (a FastAPI lifespan) to have it start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.outbox import OutboxRelay
from consumer_idem.outbox_identity import amqp_where, broker_route, kafka_where

if TYPE_CHECKING:
    from consumer_idem.faststream import Idempotency

__all__ = ["OutboxRelayTask", "faststream_route"]

log = logging.getLogger("consumer_idem.faststream")

#: how often a relay started without the app looks whether its broker still runs
BROKER_WATCH = 0.5


def faststream_route(broker: Any, transport: str) -> str:
    """The route of a FastStream broker's outbox messages (``transport``: ``kafka``,
    ``amqp``, ``nats`` or ``redis``) and its cluster, as the broker states it in its
    specification: the servers, or the AMQP URL without its credentials (the ones an app
    names with ``specification_url`` where it gives them). A runner on the same cluster has
    the same."""
    urls = [str(u) for u in getattr(getattr(broker, "specification", None), "url", None) or []]
    if transport in ("kafka", "nats", "redis"):  # a list of servers, spelled one way
        return broker_route(transport, kafka_where(urls))
    return broker_route(transport, amqp_where(urls[0] if urls else None))


class OutboxRelayTask:
    """The relay of one [`Idempotency`][consumer_idem.faststream.relay.Idempotency] middleware
    (``idem.outbox_relay``), as a task of
    the app's event loop: `start`, `stop`."""

    def __init__(self, idem: Idempotency, interval: float | None, app: Any = None) -> None:
        if interval is not None and interval <= 0:
            raise IdempotencyConfigError(
                f"outbox_relay must be > 0 seconds or None, not {interval}"
            )
        if app is not None and not all(
            callable(getattr(app, hook, None)) for hook in ("after_startup", "on_shutdown")
        ):
            raise IdempotencyConfigError(
                f"app must be a FastStream application (FastStream, AsgiFastStream), not "
                f"{type(app).__name__}: the outbox relay starts and stops with its hooks"
            )
        self.idem = idem
        self.interval = interval
        self.relay: OutboxRelay | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._with_app = app is not None
        if app is not None and interval is not None:
            app.after_startup(self._started)
            app.on_shutdown(self._stopping)

    # (hooks of their own: FastStream calls a hook with the options of its command line)
    async def _started(self) -> None:
        await self.start()

    async def _stopping(self) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Start the relay (once; nothing with ``outbox_relay=None``)."""
        if self.interval is None or self.running:
            return
        idem = self.idem
        if idem.options.mode != "transactional":
            return  # two-phase units publish nothing through the outbox
        self.relay = OutboxRelay(idem.store, idem, scopes=[idem.scope])
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._run(self.relay, self.interval), name=f"consumer-idem outbox relay {idem.scope}"
        )

    async def first_delivery(self) -> None:
        """The middleware got a delivery: a relay not started with the app starts now."""
        if not self._with_app and not self.running:
            await self.start()

    async def _run(self, relay: OutboxRelay, interval: float) -> None:
        watching = None
        if not self._with_app:  # no hook stops it: it stops with the broker
            watching = asyncio.get_running_loop().create_task(self._watch_broker())
        try:
            await relay.run(self._stop, interval)
        finally:
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching

    async def _watch_broker(self) -> None:
        broker = self.idem.broker
        while not self._stop.is_set():
            if not getattr(broker, "running", True):
                log.info("scope=%s: the broker stopped: its outbox relay stops", self.idem.scope)
                self._stop.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), BROKER_WATCH)

    async def stop(self, within: float = 10.0) -> None:
        """Stop the relay: a pass under way ends (or, after ``within`` seconds, is cancelled
        and rolled back: its messages stay pending for the next relay)."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, within)
