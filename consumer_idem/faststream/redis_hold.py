"""A Redis stream entry kept claimed while it is in hand.

Redis hands a pending entry to another consumer's claiming subscriber (``XAUTOCLAIM``) once it
has been idle for ``min_idle_time``, and an entry is idle for as long as its consumer holds it
in hand: while its handler runs, or while its dead letter is retried because Redis refuses it.
Taken by another consumer meanwhile, it is settled twice: a replay at best, a second dead
letter at worst. So while the middleware holds an entry, it claims it again for its own
consumer every third of the group's ``min_idle_time`` (``XCLAIM ... JUSTID``: its idle time
starts afresh and its delivery count stays), and stops once the entry is settled or handed
back for a retry (then it goes idle, and the claiming subscriber takes it in time). A consumer
that dies stops claiming, and the others take its entries as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from consumer_idem.faststream import _compat
from consumer_idem.faststream.redis_side import _Redis

if TYPE_CHECKING:
    from faststream import StreamMessage

    from consumer_idem.faststream import Idempotency

log = logging.getLogger("consumer_idem.faststream")


class Keeper:
    """Claims one entry for its consumer again and again, until stopped.

    A timer, not a task, waits for each claim: nearly every entry is settled long before the
    first one is due, and a timer costs a fraction of a task per delivery."""

    def __init__(self, client: Any, raw: Any, stream: Any, every: float) -> None:
        # the task running the delivery (the subscriber's loop): should it end without stop()
        # (cancelled past the middleware's exit), claiming ends with it, and the entry goes
        # idle for the claiming subscribers
        self._owner = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._client, self._raw, self._stream, self._every = client, raw, stream, every
        self._claiming: asyncio.Task[None] | None = None
        self._stopped = False
        self._timer = self._loop.call_later(every, self._due)

    def _held(self) -> bool:
        return not self._stopped and (self._owner is None or not self._owner.done())

    def _due(self) -> None:
        if self._held():
            self._claiming = self._loop.create_task(self._claim())

    async def _claim(self) -> None:
        raw, stream = self._raw, self._stream
        try:
            await self._client.xclaim(
                raw["channel"],
                stream.group,
                stream.consumer,
                0,
                list(raw["message_ids"]),
                justid=True,
            )
        except Exception as exc:  # Redis unreachable: nothing to keep it from anyway
            log.debug("could not keep entry %r claimed: %r", raw["message_ids"], exc)
        if self._held():
            self._timer = self._loop.call_later(self._every, self._due)

    def stop(self) -> None:
        self._stopped = True
        self._timer.cancel()
        if self._claiming is not None:
            self._claiming.cancel()


def keep(idem: Idempotency, message: StreamMessage[Any], subscriber: Any) -> Keeper | None:
    """Start keeping ``message`` claimed while it is in hand (Redis stream entries only)."""
    transport = idem.transport
    if not isinstance(transport, _Redis):
        return None
    stream = transport.stream_of(subscriber)
    raw = message.raw_message
    if stream is None or not stream.group or not isinstance(raw, dict):
        return None
    idle = transport.claim_after_ms(subscriber)
    if idle is None:
        return None
    with contextlib.suppress(RuntimeError):  # a test broker: no client, nothing claims
        return Keeper(_compat.redis_client(idem.broker), raw, stream, idle / 3000)
    return None
