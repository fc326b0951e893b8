"""The Redis side of a FastStream subscriber: stream consumer groups, XACK, the pending list.

Only a Redis stream read through a consumer group can be made exactly-once: Redis keeps each
entry it hands to a consumer in the group's pending-entries list (PEL) until it is ``XACK``-ed,
and a pending entry can be claimed again (``XAUTOCLAIM``) by a live consumer when its owner
died. A Redis list (``BLPOP`` removes the item) and pub/sub (nothing is kept) hand each message
over once, and a stream read without a group (``XREAD``) or with ``no_ack=True`` keeps nothing
pending: a crash or a failed commit would lose the message, so those subscribers are refused
when the broker starts.

An entry is ``XACK``-ed only after its Postgres commit. A retry leaves it pending: FastStream's
claiming subscriber (``StreamSub(..., min_idle_time=ms)``, which runs ``XAUTOCLAIM``) takes it
back once it has been idle that long, so ``min_idle_time`` is the retry delay, and the entry of
a consumer that was killed mid-run is claimed the same way and meets its record in the store
(completed: acked, never run again). Every subscriber reading new entries of a group through
the middleware therefore needs such a claiming subscriber on the same stream and group, or
nothing it leaves pending would ever run: the broker refuses to start without one.

Redis counts deliveries in the PEL (``XPENDING``'s ``times_delivered``, read through
FastStream's ``RedisStreamMessage.get_delivery_count``): a message whose handler fails on its
``max_deliveries``-th delivery is dead-lettered (``XADD`` to ``<stream>.dlq`` with its reason)
and acked only once the dead letter is written; a wait for the store or for another owner is
never dead-lettered for its count. An entry that kills the process never fails: what ends
that loop is the delivery budget (`consumer_idem.faststream.budget`). Whatever the claiming
subscriber hands over was delivered before, so it runs alone in the process, counting one
attempt of its key in Postgres right before its handler, and is dead-lettered (reason
``max_deliveries``) once ``max_deliveries`` such attempts ran without completing.

The key: FastStream's ``RedisBroker`` has no message id of its own (the parsed message's
``message_id`` is a fresh random id unless the publisher sets a ``message_id`` header). The
stream entry id is no key either: a producer that retries an ``XADD`` whose reply it lost
writes a second entry with a new id. So the default strategies read what the publisher
chose: an ``idempotency-key`` header, a CloudEvents id, or the ``message_id`` header.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from faststream import StreamMessage

from consumer_idem.consumer import Verdict
from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.faststream import _compat
from consumer_idem.faststream.delivery_limit import exhausted
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import KEY_HEADER, ORIGINAL_QUEUE, SCOPE_HEADER, Notice
from consumer_idem.transports import settle
from consumer_idem.verdict import (
    DEAD_LETTER_ERROR,
    DEAD_LETTER_KEY,
    DEAD_LETTER_REASON,
    DEAD_LETTER_SCOPE,
)

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency

log = logging.getLogger("consumer_idem.faststream")

#: the publisher's message id (FastStream reads it as the message's ``message_id``); the
#: default key strategies take it when no ``idempotency-key`` or CloudEvents id is there
MSG_ID_HEADER = "message_id"
#: the deliveries of an entry (its ``times_delivered`` in the PEL) when it was dead-lettered
DEAD_LETTER_DELIVERIES = "x-dead-letter-deliveries"
#: the id of the original stream entry of a dead letter
DEAD_LETTER_ENTRY = "x-original-entry-id"
#: why a message whose handler kept failing was dead-lettered


class _Redis:
    holds_waits = False  # a retry stays pending in Redis until the claiming subscriber takes it

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        self.idem = idem
        self.broker = broker
        # FastStream's `stream_sub` deep-copies the StreamSub on every read; a subscriber's
        # is fixed once the broker runs, so it is read once per subscriber (held too, so that
        # its id is not reused), and the group's claimers again only when a subscriber is
        # added at run time (a new claimer may claim sooner)
        self._streams: dict[int, tuple[Any, Any, int | None, int]] = {}

    def stream_of(self, subscriber: Any) -> Any:
        """``subscriber``'s `StreamSub` (None: it reads no stream), read once."""
        entry = self._streams.get(id(subscriber))
        return (entry or self._stream_entry(subscriber))[1]

    def claim_after_ms(self, subscriber: Any) -> int | None:
        """The shortest ``min_idle_time`` after which a subscriber of this broker claims the
        pending entries of ``subscriber``'s stream and group (None: none does)."""
        return self._stream_entry(subscriber)[2]

    def _stream_entry(self, subscriber: Any) -> tuple[Any, Any, int | None, int]:
        subscribers = getattr(self.broker, "subscribers", ())
        entry = self._streams.get(id(subscriber))
        if entry is None or entry[3] != len(subscribers):
            stream = getattr(subscriber, "stream_sub", None)
            idle = None if stream is None else self._claim_after_ms(stream, subscribers)
            entry = (subscriber, stream, idle, len(subscribers))
            self._streams[id(subscriber)] = entry
        return entry

    @staticmethod
    def _claim_after_ms(stream: Any, subscribers: Any) -> int | None:
        idle: list[int] = [
            int(
                getattr(sub, "min_idle_time", None)
                or getattr(sub, "claim_min_idle_time", None)
                or 0
            )
            for sub in (getattr(s, "stream_sub", None) for s in subscribers)
            if sub is not None and sub.name == stream.name and sub.group == stream.group
            if _claims(sub)
        ]
        return min(idle) if idle else None

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        raw = message.raw_message
        if not isinstance(raw, dict) or raw.get("type") != "stream":
            raise IdempotencyConfigError(
                "a Redis Idempotency middleware got a message that is not a stream entry: "
                "subscribe with stream=StreamSub(name, group=..., consumer=...)"
            )
        headers = message.headers or {}
        message_id = headers.get(MSG_ID_HEADER)
        return ConsumerMessage(
            body=message.body,
            headers={name: str(value).encode() for name, value in headers.items()},
            message_id=str(message_id) if message_id else None,
            topic=raw["channel"],
            content_type=message.content_type,
            raw=raw,
        )

    def check(self, subscriber: Any) -> None:
        """A stream subscriber of a consumer group, one entry at a time, with entries left
        pending until acked, and a subscriber claiming what stays pending."""
        stream = getattr(subscriber, "stream_sub", None)
        if stream is None:
            kind = "list" if getattr(subscriber, "list_sub", None) is not None else "pub/sub"
            raise IdempotencyConfigError(
                f"a Redis {kind} subscriber hands each message over once and cannot redeliver "
                "it, so a crash or a failed commit would lose it: subscribe with "
                "stream=StreamSub(name, group=..., consumer=...) (a stream consumer group)"
            )
        if not stream.group:
            raise IdempotencyConfigError(
                f"the stream subscriber of {stream.name!r} reads without a consumer group "
                "(XREAD): nothing stays pending, so a crash would lose an entry: give "
                "StreamSub a group= and a consumer="
            )
        if stream.no_ack:
            raise IdempotencyConfigError(
                f"the stream subscriber of {stream.name!r} reads with no_ack=True (XREADGROUP "
                "NOACK): entries are acknowledged as they are read, so a crash would lose "
                "them: leave no_ack unset"
            )
        if stream.batch and _claims(stream):
            # a claimed entry may be what killed the last consumer: it runs alone, counted
            # under the delivery budget, which a batch does not (`redis_batch` reads new ones)
            raise IdempotencyConfigError(
                f"the claiming subscriber of {stream.name!r} has batch=True: an entry it claims "
                "runs alone under the delivery budget (max_deliveries), one at a time. Claim "
                "with a single-entry subscriber (no batch=True); the reading one may be a batch"
            )
        if not _claims(stream) and not self._claimer_of(stream):
            raise IdempotencyConfigError(
                f"nothing claims the entries of stream {stream.name!r} (group {stream.group!r}) "
                f"that stay pending, through a middleware of scope {self.idem.scope!r}: a "
                "retry, or the entries of a consumer that died, would never run (or run again "
                "under another scope). Add a claiming subscriber through the same middleware: "
                f"StreamSub({stream.name!r}, group={stream.group!r}, consumer=..., "
                "min_idle_time=<ms, longer than a handler runs>)"
            )
        if not _claims(stream) and stream.max_records is None:
            log.warning(
                "the stream subscriber of %r reads every new entry at once (max_records "
                "unset): an entry waiting in hand longer than min_idle_time is claimed again "
                "(a replay, not a second effect), and XAUTOCLAIM scans a long pending list on "
                "every poll. Set StreamSub(..., max_records=10) or so",
                stream.name,
            )

    def _claimer_of(self, stream: Any) -> bool:
        """Does a subscriber of this broker claim the pending entries of ``stream``'s group
        through an Idempotency middleware of this scope? (Under another scope, an entry whose
        effect committed here would find no record there and run again.)"""
        from consumer_idem.faststream.idempotency import Idempotency

        for other in getattr(self.broker, "subscribers", ()):
            sub = getattr(other, "stream_sub", None)
            if (
                sub is not None
                and sub.name == stream.name
                and sub.group == stream.group
                and _claims(sub)
                and any(
                    isinstance(m, Idempotency) and m.scope == self.idem.scope
                    for m in _compat.subscriber_middlewares(other)
                )
            ):
                return True
        return False

    def delivered_before(self, message: StreamMessage[Any], subscriber: Any) -> bool:
        """Did Redis hand this entry to a consumer before (the delivery budget's suspect)? A
        subscriber with ``min_idle_time`` reads by ``XAUTOCLAIM`` alone, which only hands over
        entries that were pending: delivered before, and not acked since (a retry, or the
        entry of a consumer that died, maybe of this entry). Redis 8.4's ``XREADGROUP ...
        CLAIM`` (``claim_min_idle_time``) mixes new and claimed entries in one read and is
        taken for new: such a subscriber's crash loop is not cut short."""
        stream = self.stream_of(subscriber)
        return stream is not None and getattr(stream, "min_idle_time", None) is not None

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        return str(message.raw_message["channel"])

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        return None

    def permanent(self, exc: BaseException) -> bool:
        from redis.exceptions import DataError, ResponseError

        # the destination key holds no stream (WRONGTYPE), or the entry cannot be written:
        # waiting will not help, as with a missing queue
        return isinstance(exc, DataError) or (
            isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")
        )

    async def ack(self, message: StreamMessage[Any]) -> None:
        await message.ack()  # XACK of this entry in the delivery's group

    async def retry(self, message: StreamMessage[Any]) -> None:
        await message.nack()  # nothing sent: the entry stays pending until it is claimed

    async def retry_later(
        self, settler: Any, message: StreamMessage[Any], verdict: Verdict
    ) -> None:
        """Leave the entry pending; a handler that failed on the ``max_deliveries``-th
        delivery is dead-lettered instead (a wait for the store never is)."""
        limit = self.idem.max_deliveries
        if limit is not None and not settle.is_wait(verdict):
            try:
                delivered = await message.get_delivery_count()  # type: ignore[attr-defined]
            except Exception as exc:  # Redis unreachable: the entry stays pending anyway
                log.warning("could not read the delivery count: %r", exc)
                delivered = 0
            dead = exhausted(delivered, verdict, limit)
            if dead is not None:
                await settle.settle(settler, message, dead)
                return
        log.info("left pending for the claiming subscriber (%s)", verdict.reason)
        await message.nack()

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        raise NotImplementedError("Redis does not hold waits: the entry stays pending")

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None:
        raw = message.raw_message
        headers = {str(name): str(value) for name, value in (message.headers or {}).items()}
        headers.setdefault(ORIGINAL_QUEUE, source)
        headers[DEAD_LETTER_REASON] = verdict.reason or "unknown"
        headers[DEAD_LETTER_SCOPE] = verdict.scope
        headers[DEAD_LETTER_ENTRY] = b",".join(raw["message_ids"]).decode()
        if verdict.key is not None:
            headers[DEAD_LETTER_KEY] = verdict.key
        error = settle.error_header(verdict)
        if error is not None:
            headers[DEAD_LETTER_ERROR] = error
        # still pending (acked only once this is written): its count in the PEL
        headers[DEAD_LETTER_DELIVERIES] = str(await message.get_delivery_count())  # type: ignore[attr-defined]
        if body_dropped:
            headers[settle.DEAD_LETTER_BODY_DROPPED] = str(len(message.body))
        await self.publish(to, b"" if body_dropped else message.body, headers)

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self.publish(
            self.idem.reconcile_destination,
            body,
            {SCOPE_HEADER: scope, KEY_HEADER: key, "content-type": "application/json"},
        )

    async def redispatch(self, notice: Notice) -> None:
        """The original's body and headers (its key too) back to its stream, as a new entry."""
        assert notice.source is not None and notice.body is not None
        headers = {
            name: value.decode("utf-8", "backslashreplace")
            for name, value in notice.headers.items()
        }
        await self.publish(notice.source, notice.body, headers)

    async def publish(self, stream: str, body: bytes, headers: dict[str, str]) -> None:
        """``XADD`` to ``stream`` through the broker: Redis has the entry when it answers."""
        await self.broker.publish(body, stream=stream, headers=headers or None)


def _claims(stream: Any) -> bool:
    """Does this ``StreamSub`` claim pending entries (``XAUTOCLAIM``, or Redis 8.4's
    ``XREADGROUP ... CLAIM``)?"""
    return (
        getattr(stream, "min_idle_time", None) is not None
        or getattr(stream, "claim_min_idle_time", None) is not None
    )
