"""The settle path's transport for a FastStream subscriber, over the broker's side."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from faststream import StreamMessage

from consumer_idem.consumer import (
    Verdict,
    reconcile_notice,
)
from consumer_idem.faststream import batch
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.faststream.nats_side import _Nats
from consumer_idem.faststream.redis_side import _Redis
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice
from consumer_idem.transports import settle

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency

log = logging.getLogger("consumer_idem.faststream")


class _Transport(Protocol):
    """What differs between the brokers; `_Settler` turns it into the settle path's
    transport."""

    #: waits happen in hand (RabbitMQ: a hand-back would spend the delivery budget)
    holds_waits: bool

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage: ...

    def check(self, subscriber: Any) -> None: ...

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str: ...

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        """The broker properties a notice carries for a re-dispatch (AMQP's; None for Kafka,
        whose record key and coordinates are in ``incoming``)."""
        ...

    def permanent(self, exc: BaseException) -> bool: ...

    async def ack(self, message: StreamMessage[Any]) -> None: ...

    async def retry(self, message: StreamMessage[Any]) -> None: ...

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        """Publish a copy of ``message`` at the tail of ``source`` (waits held too long)."""
        ...

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None: ...

    async def notice(self, scope: str, key: str, body: bytes) -> None: ...

    async def redispatch(self, notice: Notice) -> None: ...


class _Settler(batch.SubscriberSide):
    """The settle path's transport (``consumer_idem.transports.settle.Transport``) for one
    subscriber: a subscriber that is shutting down stops retrying publishes."""

    def __init__(
        self,
        idem: Idempotency,
        subscriber: Any = None,
        incoming: ConsumerMessage | None = None,
        source: str = "",
    ) -> None:
        self.idem = idem
        self.subscriber = subscriber
        self.incoming = incoming
        self.source = source
        self.stats = idem.stats
        self.transport = idem.transport

    async def ack(self, message: StreamMessage[Any]) -> None:
        await self.transport.ack(message)

    async def retry_later(self, message: StreamMessage[Any], verdict: Verdict) -> None:
        if self.idem.budget is not None:
            await self.idem.budget.failed(message, self.subscriber, verdict)
        # a delayed nak (NATS) or an entry left pending (Redis), or its delivery budget is spent
        if isinstance(self.transport, _Nats | _Redis):
            await self.transport.retry_later(self, message, verdict)
            return
        # a wait held for max_hold already: hand it back without spending the delivery budget
        if (
            self.transport.holds_waits
            and settle.is_wait(verdict)
            and not self.stopping()
            and await settle.publish_until_sent(
                lambda: self.transport.requeue(message, self.source),
                destination=self.source,
                stopping=self.stopping,
                permanent=self.permanent,
            )
        ):
            await self.transport.ack(message)  # the copy is in the queue: drop the original
            return
        log.info("retrying in %.2fs (%s)", verdict.retry_after, verdict.reason)
        await settle.pause(verdict.retry_after, self.stopping)
        await self.give_back(message)

    async def give_back(self, message: StreamMessage[Any]) -> None:
        try:
            await self.transport.retry(message)
        except Exception as exc:  # e.g. the partition was revoked meanwhile: its next owner
            log.warning("could not hand the delivery back: %r", exc)  # re-reads it anyway

    def dead_letter_destination(self, message: StreamMessage[Any]) -> str:
        return self.idem.dead_letter_destination(self.source)

    def body_size(self, message: StreamMessage[Any]) -> int:
        return len(self.incoming.body) if self.incoming is not None else 0

    async def send_dead_letter(
        self, message: StreamMessage[Any], verdict: Verdict, body_dropped: bool
    ) -> None:
        await self.transport.dead_letter(
            message, verdict, self.source, self.dead_letter_destination(message), body_dropped
        )

    def notice_body(
        self, message: StreamMessage[Any], verdict: Verdict, with_original: bool
    ) -> bytes:
        if not with_original or self.incoming is None:
            return reconcile_notice(verdict)
        return reconcile_notice(
            verdict, self.incoming, self.source, self.transport.properties(self.incoming)
        )

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self.transport.notice(scope, key, body)

    async def send_redispatch(self, notice: Notice) -> None:
        await self.transport.redispatch(notice)
