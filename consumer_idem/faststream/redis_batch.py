"""A FastStream Redis stream batch subscriber's delivery
(``stream=StreamSub(name, group=..., consumer=..., batch=True, max_records=n)``): its members,
and how they are settled after the batch's one transaction.

The batch is decided as a Kafka batch is (`consumer_idem.faststream.batch`: one claim, one
handler call, one commit, one by one when a member fails). Each member is read as the
single-entry subscriber reads it (FastStream's own stream parser, on that entry alone), so its
key and fingerprint are the ones the claiming subscriber finds when it takes the entry back.

Redis settles each entry on its own (``XACK`` of its id), with no order to keep between them:
each member's dead letter or reconciliation notice is ``XADD``-ed first; then every member the
commit settled is acked, in one ``XACK`` of their ids. A member that must wait (a retry, its key
in progress elsewhere, the store down), and the members the core did not reach after it, are
left pending for the claiming subscriber, which takes each back after ``min_idle_time``. A
member whose handler failed on its ``max_deliveries``-th delivery (its count in the pending
list) is dead-lettered, as a single entry is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from faststream import StreamMessage
from faststream.redis.parser import RedisStreamParser, SimpleParserConfig

from consumer_idem.consumer import Verdict, settled_by_commit
from consumer_idem.faststream import _compat
from consumer_idem.faststream.batch import MemberSettler
from consumer_idem.faststream.delivery_limit import exhausted
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency
    from consumer_idem.faststream.redis_side import _Redis

log = logging.getLogger("consumer_idem.faststream")


async def members(
    transport: _Redis, subscriber: Any, message: StreamMessage[Any]
) -> list[ConsumerMessage]:
    """Each entry of the batch as a single-entry subscriber of ``subscriber``'s stream parses
    it (its ``raw``: that entry's own ``RedisStreamMessage``, bound to the batch's client and
    group, so it acks and counts its deliveries alone)."""
    raw = message.raw_message
    parser = RedisStreamParser(SimpleParserConfig(_compat.redis_message_format(subscriber)))
    client, group = message.consumer, message.group  # type: ignore[attr-defined]
    views = []
    for entry_id, data in zip(raw["message_ids"], raw["data"], strict=True):
        entry = {"type": "stream", "channel": raw["channel"], "message_ids": [entry_id]}
        one = await parser.parse_message({**entry, "data": data})
        one.consumer, one.group = client, group  # type: ignore[attr-defined]
        views.append(dataclasses.replace(transport.incoming(one), raw=one))
    return views


def narrowed(message: StreamMessage[Any], run: Sequence[ConsumerMessage]) -> StreamMessage[Any]:
    """The batch as FastStream would have delivered the entries of ``run`` only: its decoder
    reads ``body``, the JSON list of the members' bodies."""
    from consumer_idem.faststream.handler_call import guarded

    raw = message.raw_message
    position = {entry_id: i for i, entry_id in enumerate(raw["message_ids"])}
    picked = [position[entry_id(m)] for m in run]
    bodies = json.loads(message.body)
    copy = guarded(message)
    copy.raw_message = {
        "type": "bstream",
        "channel": raw["channel"],
        "message_ids": [raw["message_ids"][i] for i in picked],
        "data": [raw["data"][i] for i in picked],
    }
    copy.body = json.dumps([bodies[i] for i in picked]).encode()
    if message.batch_headers:
        copy.batch_headers = [message.batch_headers[i] for i in picked]
        copy.headers = (
            {**copy.batch_headers[0], "content-type": message.content_type} if picked else {}
        )
    return copy


def entry_id(member: ConsumerMessage) -> bytes:
    return cast(bytes, member.raw.raw_message["message_ids"][0])


class _Member(NamedTuple):
    message: StreamMessage[Any]  # the entry's own RedisStreamMessage
    incoming: ConsumerMessage


class _RedisBatchSettler(MemberSettler):
    """The settle path's transport (``consumer_idem.transports.settle.Transport``) for the
    members of one batch: acks are collected and sent after every publish; a retry is nothing
    sent (the entry stays pending)."""

    def __init__(self, idem: Idempotency, subscriber: Any) -> None:
        self.idem = idem
        self.subscriber = subscriber
        self.stats = idem.stats
        self.transport = cast("_Redis", idem.transport)  # batch.members() checked it
        self.acks: list[bytes] = []
        self.left = 0  # members left pending

    async def ack(self, delivery: _Member) -> None:
        self.acks.append(entry_id(delivery.incoming))

    async def retry_later(self, delivery: _Member, verdict: Verdict) -> None:
        if self.idem.budget is not None:  # a first delivery's failed run counts now
            await self.idem.budget.failed(delivery.message, self.subscriber, verdict)
        limit = self.idem.max_deliveries
        if limit is not None and not settle.is_wait(verdict):
            try:
                delivered = await delivery.message.get_delivery_count()  # type: ignore[attr-defined]
            except Exception as exc:  # Redis unreachable: the entry stays pending anyway
                log.warning("could not read the delivery count: %r", exc)
                delivered = 0
            dead = exhausted(delivered, verdict, limit)
            if dead is not None:
                await settle.settle(self, delivery, dead)
                return
        log.info("left pending for the claiming subscriber (%s)", verdict.reason)
        self.left += 1

    async def give_back(self, delivery: _Member) -> None:
        self.left += 1  # nothing to send: it stays pending

    def source(self, delivery: _Member) -> str:
        return str(delivery.incoming.topic)

    async def send_dead_letter(
        self, delivery: _Member, verdict: Verdict, body_dropped: bool
    ) -> None:
        to = self.dead_letter_destination(delivery)
        await self.transport.dead_letter(
            delivery.message, verdict, self.source(delivery), to, body_dropped
        )


async def settle_batch(
    idem: Idempotency,
    subscriber: Any,
    run: Sequence[ConsumerMessage],
    verdicts: Sequence[Verdict | None],
) -> bool:
    """Settle each member (``verdicts[i]`` for ``run[i]``; missing or None: not decided, as
    after a wait: left pending); one ``XACK`` last. True when every member was acked."""
    settler = _RedisBatchSettler(idem, subscriber)
    stats = settler.stats
    for i, incoming in enumerate(run):
        verdict = verdicts[i] if i < len(verdicts) else None
        if verdict is None:  # the core stopped at a wait: not run, left pending with it
            settler.left += 1
        elif settled_by_commit(verdict):
            settle.count_ack(stats, verdict)
            stats.processed += 1
            settler.acks.append(entry_id(incoming))
        else:
            await settle.settle(settler, _Member(incoming.raw, incoming), verdict)
    if settler.acks:
        one = run[0].raw  # every member is bound to the batch's client and group
        try:
            await one.consumer.xack(run[0].topic, one.group, *settler.acks)
        except Exception as exc:  # they stay pending: claimed again, and replayed
            log.warning("XACK of %d batch members failed: %r", len(settler.acks), exc)
            return False
    return settler.left == 0
