"""Publishing to Kafka: which publish errors are permanent, and the sender of the
transactional outbox (`KafkaOutboxSender`). ``KafkaRunner`` publishes its outgoing
messages through this sender and judges its dead-letter and notice publishes by the same
errors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    InvalidTopicError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from aiokafka.partitioner import DefaultPartitioner

from consumer_idem.outbox import HeldBack, OutgoingMessage
from consumer_idem.outbox_identity import broker_route, kafka_where

#: publish errors that recur for the same record and topic: retrying them would block the
#: partition for ever (anything else from the broker is treated as transient)
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    UnsupportedForMessageFormatError,
    PolicyViolationError,
    # the client's own checks of what it is given (header types...): the same next time
    AssertionError,
    TypeError,
    ValueError,
)

#: an outgoing message bigger than this goes through ``producer.send()`` on its own, where the
#: producer's size checks refuse it at once (it is parked, not the batch it would have joined)
SMALL_MESSAGE = 16 * 1024


class KafkaOutboxSender:
    """Sends outgoing messages of the transactional outbox (``consumer_idem.outbox``) with an
    ``AIOKafkaProducer`` you started (create it with ``acks="all"`` and
    ``enable_idempotence=True``): the destination is the topic, ``key`` the record key.

    Messages are appended to one producer batch per topic partition, handed over in order,
    and only then are the confirmations awaited: a dispatch costs one request per partition
    and far less work per message than a ``send()`` each. Keyed messages are placed by Kafka's
    default partitioner (murmur2, as the Java client and aiokafka place them), so messages with
    one key share a partition and the idempotent producer keeps their order; those without a
    key go to a random partition.

    ``cluster``: the cluster the producer reaches (its bootstrap servers, in any order, or a
    name of yours).
    The sender's ``route`` (``kafka:<cluster>``, ``kafka`` without one) is recorded with each
    outgoing message, and a relay with this sender sends only messages of that route: name the
    cluster when a process sends to more than one."""

    def __init__(self, producer: AIOKafkaProducer, *, cluster: str | None = None) -> None:
        self.producer = producer
        # a bootstrap list names one cluster in any order: "a:9092,b:9092" is "b:9092,a:9092"
        self.route = broker_route("kafka", kafka_where(cluster))
        self._partitioner = DefaultPartitioner()

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PERMANENT_ERRORS)

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        producer = self.producer
        results: list[BaseException | None] = [None] * len(messages)
        handed: list[tuple[list[int], asyncio.Future[Any]]] = []  # (messages, confirmation)
        filling: dict[tuple[str, int], tuple[Any, list[int]]] = {}  # open batch per partition
        held: dict[Any, BaseException] = {}  # groups whose order a failure interrupted

        def failed(members: list[int], exc: BaseException) -> None:
            for i in members:
                results[i] = exc
                if not self.permanent(exc):
                    held[messages[i].group] = exc

        async def hand_over(tp: tuple[str, int]) -> None:
            batch, members = filling.pop(tp)
            try:
                handed.append((members, await producer.send_batch(batch, tp[0], partition=tp[1])))
            except Exception as exc:
                failed(members, exc)

        for i, m in enumerate(messages):
            if m.group in held:
                results[i] = HeldBack(f"held back after {held[m.group]!r}")
                continue
            try:
                partitions = sorted(await producer.partitions_for(m.destination))
                tp = (m.destination, self._partitioner(m.key, partitions, partitions))
                headers = list(m.headers)
                if len(m.body) + len(m.key or b"") > SMALL_MESSAGE:
                    if tp in filling:  # what was published before it goes first
                        await hand_over(tp)
                    sent = await producer.send(
                        m.destination, value=m.body, key=m.key, headers=headers, partition=tp[1]
                    )
                    handed.append(([i], sent))
                    continue
                batch, members = filling.get(tp) or (producer.create_batch(), [])
                if batch.append(key=m.key, value=m.body, timestamp=None, headers=headers) is None:
                    filling[tp] = (batch, members)
                    await hand_over(tp)  # full: a new one (a small message fits an empty one)
                    batch, members = producer.create_batch(), []
                    batch.append(key=m.key, value=m.body, timestamp=None, headers=headers)
                filling[tp] = (batch, [*members, i])
            except Exception as exc:  # refused before it left (too large, no metadata...)
                failed([i], exc)
        for tp in list(filling):
            await hand_over(tp)
        confirmed = await asyncio.gather(*(f for _, f in handed), return_exceptions=True)
        for (members, _), outcome in zip(handed, confirmed, strict=True):
            if isinstance(outcome, BaseException):
                for i in members:
                    results[i] = outcome
        return results
