"""Settling a FastStream NATS batch pull subscriber's delivery
(``pull_sub=PullSub(batch_size, batch=True)``) after its one transaction.

The batch is decided as a Kafka batch is (`consumer_idem.faststream.batch`: one claim, one
handler call, one commit, one by one when a member fails), but JetStream settles each message
on its own, with no order to keep between them: each member's dead letter or reconciliation
notice is published through JetStream and confirmed first; then every member the commit
settled is acked (``ack_sync``, all at once, each confirmed by the server); a member that must
wait (a retry, its key in progress elsewhere, the store down), and the members the core did not
reach after it, are ``nak``-ed with the wait's delay. A member whose handler failed on its
``max_deliveries``-th delivery is dead-lettered, as a single message is. A member JetStream
delivered before ran alone, under the crash budget (`consumer_idem.faststream.batch_budget`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from consumer_idem.consumer import Verdict, settled_by_commit
from consumer_idem.faststream.batch import MemberSettler
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency
    from consumer_idem.faststream.nats_side import _Nats

log = logging.getLogger("consumer_idem.faststream")


class _Member(NamedTuple):
    raw: Any  # nats-py's Msg
    incoming: ConsumerMessage


class _NatsBatchSettler(MemberSettler):
    """The settle path's transport (``consumer_idem.transports.settle.Transport``) for the
    members of one batch: acks and naks are collected, and sent after every publish."""

    def __init__(self, idem: Idempotency, subscriber: Any) -> None:
        self.idem = idem
        self.subscriber = subscriber
        self.stats = idem.stats
        self.transport = cast("_Nats", idem.transport)  # batch.members() checked it
        self.acks: list[Any] = []
        self.naks: list[tuple[Any, float | None]] = []

    async def ack(self, delivery: _Member) -> None:
        self.acks.append(delivery.raw)

    async def retry_later(self, delivery: _Member, verdict: Verdict) -> None:
        exhausted = self.transport.exhausted(delivery.raw, verdict)
        if exhausted is not None:
            await settle.settle(self, delivery, exhausted)
            return
        log.info("retrying in %.2fs (%s)", verdict.retry_after, verdict.reason)
        self.naks.append((delivery.raw, verdict.retry_after))

    async def give_back(self, delivery: _Member) -> None:
        self.naks.append((delivery.raw, None))

    def source(self, delivery: _Member) -> str:
        return str(delivery.raw.subject)

    async def send_dead_letter(
        self, delivery: _Member, verdict: Verdict, body_dropped: bool
    ) -> None:
        to = self.dead_letter_destination(delivery)
        await self.transport.dead_letter_raw(
            delivery.raw, verdict, self.source(delivery), to, body_dropped
        )


async def settle_batch(
    idem: Idempotency,
    subscriber: Any,
    run: Sequence[ConsumerMessage],
    verdicts: Sequence[Verdict | None],
) -> bool:
    """Settle each member (``verdicts[i]`` for ``run[i]``; missing or None: not decided, as
    after a wait); acks last. True when every member was acked."""
    settler = _NatsBatchSettler(idem, subscriber)
    stats = settler.stats
    undecided = []
    for i, incoming in enumerate(run):
        verdict = verdicts[i] if i < len(verdicts) else None
        if verdict is None:  # the core stopped at a wait: not run, handed back with it
            undecided.append(incoming.raw)
        elif settled_by_commit(verdict):
            settle.count_ack(stats, verdict)
            stats.processed += 1
            settler.acks.append(incoming.raw)
        else:
            await settle.settle(settler, _Member(incoming.raw, incoming), verdict)
    if undecided:
        wait = max((d for _, d in settler.naks if d is not None), default=None)
        settler.naks.extend((raw, wait) for raw in undecided)
    # each ack confirmed by the server; one that fails is delivered again and replayed
    await _all("ack", [raw.ack_sync() for raw in settler.acks])
    await _all("nak", [raw.nak(delay=delay) for raw, delay in settler.naks])
    return not settler.naks


async def _all(what: str, calls: list[Any]) -> None:
    for failure in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(failure, BaseException):
            log.warning("%s of a batch member failed (it is delivered again): %r", what, failure)
