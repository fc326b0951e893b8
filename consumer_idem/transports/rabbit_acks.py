"""Acks of one channel's deliveries in batch mode (``RabbitRunner`` with a batch consumer),
in as few ``basic.ack(multiple=True)`` frames as is safe."""

from __future__ import annotations

import time
from typing import Any

from aio_pika.abc import AbstractIncomingMessage


class AckWindow:
    """The acks of one channel's deliveries, in as few frames as is safe (batch mode).

    RabbitMQ numbers a channel's deliveries 1, 2, 3...; ``basic.ack(multiple=True)`` of tag T
    acks every delivery up to T that is still unacked on the channel. So it is sent only for a
    run of tags that are all known here and all either ready to ack or settled already (acked
    or handed back one by one): a delivery still in hand, or not seen yet, ends the run. A
    ready delivery above such a gap is acked on its own once it has waited ``linger`` seconds
    for the gap to close: a delivery held for minutes must not keep the others unacked (they
    would fill the prefetch window).
    """

    def __init__(self, channel: Any, linger: float) -> None:
        self.channel = channel
        self.linger = linger
        #: every tag up to this one is settled
        self.floor = 0
        self._ready: dict[int, tuple[AbstractIncomingMessage, float]] = {}
        self._settled: set[int] = set()

    @property
    def pending(self) -> bool:
        return bool(self._ready)

    def abandon(self) -> None:
        """The channel is gone: its deliveries cannot be acked (the broker redelivers them)."""
        self._ready.clear()

    def ready(self, message: AbstractIncomingMessage) -> None:
        """``message`` may be acked now (its work committed, its publishes were confirmed)."""
        assert message.delivery_tag is not None
        self._ready[message.delivery_tag] = (message, time.monotonic())

    def settled(self, tag: int | None) -> None:
        """The delivery ``tag`` was acked or handed back on its own (after the frame went out:
        a multiple ack must never cover a tag that is about to be nacked)."""
        if tag is not None and tag > self.floor:
            self._settled.add(tag)

    async def flush(self) -> float | None:
        """Ack what may be acked now. Returns the seconds until a ready delivery waiting above
        a gap is due to be acked on its own, or None when none is left."""
        top, last = self.floor, None
        while True:
            tag = top + 1
            if tag in self._ready:
                last = tag
            elif tag not in self._settled:
                break
            top = tag
        if top > self.floor:
            # bookkeeping before the frame: a failed ack is not sent again (its channel is
            # gone, and the broker redelivers what it had not acked)
            self.floor = top
            self._settled = {t for t in self._settled if t > top}
            covered = [t for t in self._ready if t <= top]
            message = self._ready[last][0] if last is not None else None
            for t in covered:
                del self._ready[t]
            if message is not None:
                await message.ack(multiple=True)
        now = time.monotonic()
        due: float | None = None
        for tag, (message, since) in list(self._ready.items()):
            left = self.linger - (now - since)
            if left > 0:
                due = left if due is None else min(due, left)
                continue
            del self._ready[tag]
            await message.ack()
            self.settled(tag)
        return due
