"""The Kafka side of a FastStream subscriber on Confluent's client (``faststream.confluent``).

The same offset discipline as the aiokafka side (`consumer_idem.faststream.kafka_side`), whose
logic this reuses: after the Postgres commit, one commit names the partition of the settled
record and the offset after it (a batch: each partition up to its first record not settled),
never "every partition's position", which FastStream's own ``ack()`` commits; a retry seeks the
partition back to the record; dead letters and notices are published, and confirmed, through
the broker before the commit. Only what differs between the clients is here: Confluent's
records expose their coordinates as methods (a `ConfluentRecord` view gives them aiokafka's
attribute shape), commits go through librdkafka, and librdkafka's own auto-commit, which a
broker's ``config=`` can turn back on under ``AckPolicy.MANUAL``, is refused at start-up.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.faststream import _compat
from consumer_idem.faststream.kafka_side import _Kafka
from consumer_idem.message import ConsumerMessage

log = logging.getLogger("consumer_idem.faststream")

#: librdkafka's spellings of "off" (it reads booleans case-insensitively; FastStream passes the
#: broker's ``config=`` through as given): any other value may turn auto-commit on, so is refused
_FALSE = ("false", "f", "0")


@dataclass(frozen=True, slots=True)
class ConfluentRecord:
    """A ``confluent_kafka.Message`` with aiokafka's record attributes, read once."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    #: the client's own message
    message: Any


def record_view(message: Any) -> ConfluentRecord:
    """The view of a ``confluent_kafka.Message`` (or FastStream's test double of one)."""
    key = message.key()
    return ConfluentRecord(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        key=key.encode() if isinstance(key, str) else key,
        value=message.value(),
        headers=[(name, _header_bytes(value)) for name, value in (message.headers() or ())],
        message=message,
    )


def _header_bytes(value: str | bytes | None) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else value


class _Confluent(_Kafka):
    """A ``faststream.confluent.KafkaBroker``'s subscribers (see the module docstring)."""

    def _bind_client(self) -> None:
        from confluent_kafka import KafkaException, TopicPartition
        from faststream.confluent.helpers.client import AsyncConfluentConsumer

        self._consumer_type = AsyncConfluentConsumer
        self._tp = TopicPartition
        # KafkaException: rebalancing, no longer ours; RuntimeError: the consumer is closed
        # (a background commit after the subscriber stopped)
        self._commit_errors = (KafkaException, RuntimeError)
        self._last_view: tuple[Any, ConfluentRecord] | None = None

    def durable_producer(self) -> bool:
        config = _compat.confluent_connection(self.broker).producer_config
        return config.get("acks", "all") in ("all", -1, "-1")

    def view(self, record: Any) -> Any:
        if isinstance(record, ConfluentRecord):
            return record
        # one delivery asks for its record's view several times (its message, its source,
        # its settling); the client's accessors are calls into librdkafka, so the last view
        # is kept (with its record, so the identity test cannot match another)
        last = self._last_view
        if last is not None and last[0] is record:
            return last[1]
        view = record_view(record)
        self._last_view = (record, view)
        return view

    def message_of(self, record: Any) -> ConsumerMessage:
        view = self.view(record)
        return ConsumerMessage(
            body=view.value or b"",
            headers=dict(view.headers),
            topic=view.topic,
            partition=view.partition,
            offset=view.offset,
            record_key=view.key,
            raw=view.message,
        )

    def check(self, subscriber: Any) -> None:
        # (max_workers > 1 needs AckPolicy.ACK_FIRST here: FastStream refuses it with manual
        # commits, and startup refuses every policy but MANUAL)
        consumer_config = _compat.confluent_connection(self.broker).consumer_config
        if "enable.auto.commit" in consumer_config and not plainly_off(
            consumer_config["enable.auto.commit"]
        ):
            value = consumer_config["enable.auto.commit"]
            raise IdempotencyConfigError(
                f"the KafkaBroker's config sets enable.auto.commit={value!r}, not plainly off "
                "(False, 0, 'false', 'f', '0'): librdkafka would commit each fetched record's "
                "offset in the background, before the handler ran or its transaction "
                "committed, so a failure or crash would lose messages. Remove it "
                "(ack_policy=AckPolicy.MANUAL turns auto-commit off)"
            )

    def permanent(self, exc: BaseException) -> bool:
        from confluent_kafka import KafkaError, KafkaException

        if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
            return exc.args[0].code() in _permanent_codes()
        # the client's own checks of what it is given (header types...): the same next time
        return isinstance(exc, TypeError | ValueError | AssertionError)

    async def _commit_offsets(
        self, consumer: Any, offsets: dict[tuple[str, int], int], wait: bool
    ) -> None:
        offsets_list = [self._tp(topic, part, offset) for (topic, part), offset in offsets.items()]
        await _compat.confluent_commit(consumer, offsets_list, wait)

    async def _seek_one(self, consumer: Any, tp: tuple[str, int], offset: int) -> None:
        await consumer.seek(topic=tp[0], partition=tp[1], offset=offset)


def plainly_off(value: Any) -> bool:
    """Whether a librdkafka boolean setting is surely off: ``False``, ``0`` or a string
    librdkafka reads as false; anything else (``"TRUE"``, ``"t"``, a typo) is not."""
    if isinstance(value, bool | int):
        return value is False or (type(value) is int and value == 0)
    return isinstance(value, str) and value.strip().lower() in _FALSE


@functools.cache
def _permanent_codes() -> frozenset[int]:
    """librdkafka's errors that recur for the same record and topic (as the aiokafka side's
    ``PERMANENT_ERRORS``): retrying them would block the partition for ever."""
    from confluent_kafka import KafkaError

    names = (
        "MSG_SIZE_TOO_LARGE",
        "RECORD_LIST_TOO_LARGE",
        "INVALID_TOPIC_EXCEPTION",
        "TOPIC_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "UNSUPPORTED_FOR_MESSAGE_FORMAT",
        "POLICY_VIOLATION",
        "_INVALID_ARG",
    )
    return frozenset(getattr(KafkaError, n) for n in names if hasattr(KafkaError, n))
