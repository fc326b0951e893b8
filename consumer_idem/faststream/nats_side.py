"""The NATS side of a FastStream subscriber: JetStream acks, delayed naks, confirmed publishes.

Only a JetStream consumer with explicit acks can be made exactly-once: the server keeps each
message until it is acked and redelivers it otherwise. Core NATS subscribers (and key-value or
object-store watchers) get each message once, with nothing to ack, so a crash or a failed
commit would lose it: they are refused when the broker starts.

A delivery is acked (``ack_sync``: the server confirms it) only after its Postgres commit, and
dead letters and reconciliation notices are published through JetStream and confirmed by its
``PubAck`` before the original is acked. A retry is a ``nak`` with the retry delay, so the
message waits on the server, not in hand. JetStream counts deliveries (``num_delivered``):
after ``max_deliveries`` a message whose handler keeps failing is dead-lettered; a message
waiting for the store (an outage) or for another owner is never dead-lettered for its count,
nor are those deliveries counted against its handler's later failures. A message JetStream
delivered before runs under the delivery budget (`consumer_idem.faststream.budget`): alone in its
process, one attempt counted in Postgres ahead of the handler, so a message that kills the
process is dead-lettered too.
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

#: the publisher's deduplication id (JetStream drops a second publish with the same id inside
#: the stream's duplicate window); the default key strategy reads it as the message id
MSG_ID_HEADER = "Nats-Msg-Id"
#: the JetStream deliveries of a message when it was dead-lettered
DEAD_LETTER_DELIVERIES = "x-dead-letter-deliveries"
#: why a message whose handler kept failing was dead-lettered
#: seconds to wait for JetStream's ``PubAck`` of a dead letter or notice
PUBLISH_TIMEOUT = 10.0


class _Nats:
    holds_waits = False  # a nak with a delay keeps the message on the server, not in hand

    def __init__(self, idem: Idempotency, broker: Any) -> None:
        self.idem = idem
        self.broker = broker

    def incoming(self, message: StreamMessage[Any]) -> ConsumerMessage:
        return self.incoming_raw(message.raw_message)

    def incoming_raw(self, raw: Any) -> ConsumerMessage:
        """The transport-neutral view of one nats-py ``Msg`` (a batch's member too)."""
        metadata = _metadata(raw)
        headers = dict(raw.headers or {})
        return ConsumerMessage(
            body=raw.data,
            headers={name: str(value).encode() for name, value in headers.items()},
            message_id=headers.get(MSG_ID_HEADER) or None,
            topic=raw.subject,
            offset=metadata.sequence.stream,
            delivery_count=metadata.num_delivered,
            content_type=headers.get("content-type"),
            raw=raw,
        )

    def delivered_before(self, message: StreamMessage[Any], subscriber: Any) -> bool:
        """Did JetStream deliver ``message`` before (the delivery budget's suspect)?"""
        return bool(_metadata(message.raw_message).num_delivered > 1)

    def check(self, subscriber: Any) -> None:
        """A JetStream subscriber (push, pull or batch pull) with explicit acks, whose
        consumer does not stop redelivering before ``max_deliveries`` does."""
        stream = getattr(subscriber, "stream", None)
        if stream is None:
            raise IdempotencyConfigError(
                "a core NATS subscriber (no JetStream stream) gets each message once and cannot "
                "redeliver it, so a crash or a failed commit would lose it: subscribe with "
                "stream=JStream(...) (a durable JetStream consumer with explicit acks)"
            )
        if _compat.nats_acks_on_delivery(subscriber):
            raise IdempotencyConfigError(
                "this JetStream subscriber acks each message as it arrives "
                "(ack_policy=AckPolicy.ACK_FIRST), before the handler runs, so a failure or "
                "crash would lose it: subscribe with ack_policy=AckPolicy.MANUAL"
            )
        if _compat.nats_ordered_consumer(subscriber):
            raise IdempotencyConfigError(
                "an ordered JetStream consumer (ordered_consumer=True) acks nothing and "
                "redelivers nothing (ack policy 'none'), so a failure or crash would lose the "
                "message: subscribe with a durable consumer and explicit acks"
            )
        self.check_config(getattr(subscriber, "config", None))

    def check_config(self, config: Any) -> None:
        """A consumer config (the subscriber's own, or the one the server holds) with explicit
        acks and redelivering at least ``max_deliveries`` times."""
        ack_policy = getattr(config, "ack_policy", None)
        if ack_policy is not None and str(getattr(ack_policy, "value", ack_policy)) != "explicit":
            raise IdempotencyConfigError(
                f"the JetStream consumer has ack_policy={ack_policy!s}: only 'explicit' lets each "
                "message be acked after its own commit ('none' settles on delivery, 'all' acks "
                "every earlier message with one ack)"
            )
        max_deliver = getattr(config, "max_deliver", None)
        limit = self.idem.max_deliveries
        if max_deliver is not None and max_deliver > 0 and (limit is None or max_deliver <= limit):
            raise IdempotencyConfigError(
                f"the JetStream consumer stops redelivering after max_deliver={max_deliver}, "
                f"before the middleware's max_deliveries={limit} dead-letters it, so the server "
                "would drop the message silently: leave max_deliver unset (-1) or raise it"
            )

    async def check_server(self, subscriber: Any) -> None:
        """The durable consumer the server already holds, if any: nats-py binds to it as it
        is (an operator's edit, an earlier deploy's settings), not to the subscriber's config,
        so the same checks apply to the server's copy before anything is fetched. (Run as the
        subscriber starts: its pull subscription's fetch timeouts are made one kind here too,
        `consumer_idem.faststream._compat.catch_fetch_timeouts`.)"""
        _compat.catch_fetch_timeouts(subscriber)
        from nats.js import JetStreamContext  # type: ignore[import-not-found, unused-ignore]
        from nats.js.errors import NotFoundError  # type: ignore[import-not-found, unused-ignore]

        stream = getattr(getattr(subscriber, "stream", None), "name", None)
        durable = getattr(getattr(subscriber, "config", None), "durable_name", None)
        jetstream = getattr(subscriber, "jetstream", None)
        if not stream or not durable or not isinstance(jetstream, JetStreamContext):
            return  # an ephemeral consumer is created from the checked config
        try:
            info = await jetstream.consumer_info(stream, durable)
        except NotFoundError:
            return  # created from the subscriber's checked config
        try:
            self.check_config(info.config)
        except IdempotencyConfigError as exc:
            raise IdempotencyConfigError(
                f"the durable consumer {durable!r} on stream {stream!r} already exists on the "
                f"server with other settings: {exc}"
            ) from None

    def source(self, message: StreamMessage[Any], subscriber: Any) -> str:
        return str(message.raw_message.subject)

    def properties(self, incoming: ConsumerMessage) -> dict[str, Any] | None:
        return None

    def permanent(self, exc: BaseException) -> bool:
        # (the ignores: a venv without the nats extra type-checks too)
        from nats.errors import (  # type: ignore[import-not-found, unused-ignore]
            BadSubjectError,
            MaxPayloadError,
        )
        from nats.js.errors import (  # type: ignore[import-not-found, unused-ignore]
            NoStreamResponseError,
        )

        # no stream takes the subject: waiting will not help, as with a missing queue
        return isinstance(exc, BadSubjectError | MaxPayloadError | NoStreamResponseError)

    async def ack(self, message: StreamMessage[Any]) -> None:
        await message.ack_sync()  # type: ignore[attr-defined]  # NatsMessage: server-confirmed

    async def retry(self, message: StreamMessage[Any]) -> None:
        await message.nack()

    async def retry_later(
        self, settler: Any, message: StreamMessage[Any], verdict: Verdict
    ) -> None:
        """``nak`` with the verdict's delay; a handler that failed on the ``max_deliveries``-th
        delivery is dead-lettered instead (a wait for the store never is)."""
        exhausted = self.exhausted(message.raw_message, verdict)
        if exhausted is not None:
            await settle.settle(settler, message, exhausted)
            return
        log.info("retrying in %.2fs (%s)", verdict.retry_after, verdict.reason)
        await message.nack(delay=verdict.retry_after)  # type: ignore[call-arg]

    def exhausted(self, raw: Any, verdict: Verdict) -> Verdict | None:
        """The dead-letter verdict of a retry whose handler failed on the ``max_deliveries``-th
        JetStream delivery of ``raw`` (None: ``nak`` it). Only the key's own failed runs
        count, as the store counted them: deliveries ``nak``-ed while waiting for the store or
        for another owner raise ``num_delivered`` too, and spend nothing."""
        return exhausted(_metadata(raw).num_delivered, verdict, self.idem.max_deliveries)

    async def requeue(self, message: StreamMessage[Any], source: str) -> None:
        raise NotImplementedError("NATS does not hold waits: a delayed nak keeps it on the server")

    async def dead_letter(
        self,
        message: StreamMessage[Any],
        verdict: Verdict,
        source: str,
        to: str,
        body_dropped: bool = False,
    ) -> None:
        await self.dead_letter_raw(message.raw_message, verdict, source, to, body_dropped)

    async def dead_letter_raw(
        self, raw: Any, verdict: Verdict, source: str, to: str, body_dropped: bool = False
    ) -> None:
        """One nats-py ``Msg`` to ``to`` with the reason in its headers (a batch's member
        too)."""
        headers = {
            name: str(value)
            for name, value in (raw.headers or {}).items()
            # a copy with the original's dedup id would be dropped by a stream holding both
            if name != MSG_ID_HEADER
        }
        headers.setdefault(ORIGINAL_QUEUE, source)
        headers[DEAD_LETTER_REASON] = verdict.reason or "unknown"
        headers[DEAD_LETTER_SCOPE] = verdict.scope
        headers[DEAD_LETTER_DELIVERIES] = str(_metadata(raw).num_delivered)
        if verdict.key is not None:
            headers[DEAD_LETTER_KEY] = verdict.key
        error = settle.error_header(verdict)
        if error is not None:
            headers[DEAD_LETTER_ERROR] = error
        if body_dropped:
            headers[settle.DEAD_LETTER_BODY_DROPPED] = str(len(raw.data))
        await self.publish(to, b"" if body_dropped else raw.data, headers)

    async def notice(self, scope: str, key: str, body: bytes) -> None:
        await self.publish(
            self.idem.reconcile_destination,
            body,
            {SCOPE_HEADER: scope, KEY_HEADER: key, "content-type": "application/json"},
        )

    async def redispatch(self, notice: Notice) -> None:
        """The original's body and headers (its ``Nats-Msg-Id`` too: the key) back to its
        subject. Inside the stream's duplicate window the server discards it as a duplicate of
        the original: that raises, so the re-dispatch is tried again later."""
        assert notice.source is not None and notice.body is not None
        headers = {
            name: value.decode("utf-8", "backslashreplace")
            for name, value in notice.headers.items()
        }
        await self.publish(notice.source, notice.body, headers, refuse_duplicate=True)

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str], refuse_duplicate: bool = False
    ) -> None:
        """Publish through JetStream and wait for its ``PubAck``: the message is stored (a
        subject no stream takes fails with ``NoStreamResponseError``)."""
        stream = self.broker.connection.jetstream()
        ack = await stream.publish(subject, body, headers=headers or None, timeout=PUBLISH_TIMEOUT)
        if refuse_duplicate and ack.duplicate:
            raise RuntimeError(
                f"JetStream discarded the re-dispatch to {subject!r} as a duplicate of the "
                "original (inside the stream's duplicate window): it is tried again later"
            )


def _metadata(raw: Any) -> Any:
    """JetStream's metadata of a delivery (stream sequence, ``num_delivered``)."""
    try:
        return raw.metadata
    except Exception as exc:  # a core NATS message has no reply subject to parse
        raise IdempotencyConfigError(
            "a NATS Idempotency middleware got a message without JetStream metadata (core "
            "NATS): subscribe with stream=JStream(...)"
        ) from exc
