"""Batch mode's collector: deliveries from a RabbitMQ channel's prefetch window grouped into
batches of at most ``size``, or whatever arrived within ``wait`` seconds of the first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage


class BatchCollector:
    """Gathers deliveries; each batch it closes goes to ``ready``."""

    def __init__(
        self, size: int, wait: float, ready: Callable[[list[AbstractIncomingMessage]], object]
    ) -> None:
        self.size = size
        self.wait = wait
        self.ready = ready
        #: the deliveries gathered for the next batch, and the timer that closes it
        self.gathered: list[AbstractIncomingMessage] = []
        self._closer: asyncio.TimerHandle | None = None

    def add(self, message: AbstractIncomingMessage) -> None:
        self.gathered.append(message)
        if len(self.gathered) >= self.size:
            self.close()
        elif self._closer is None:
            self._closer = asyncio.get_running_loop().call_later(self.wait, self.close)

    def close(self) -> None:
        """The batch gathered so far goes out now (nothing when none is)."""
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        if self.gathered:
            batch, self.gathered = self.gathered, []
            self.ready(batch)
