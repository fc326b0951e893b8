"""Where a message's idempotency key comes from. Strategies compose in a fallback order.

A strategy returns the key (str, or bytes to be decoded strictly), or ``None`` when the message
does not carry one, so the next strategy is tried. Never use FastStream's ``message_id``: it is
generated per publish and is not unique per unit of work.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from consumer_idem.errors import InvalidKey
from consumer_idem.message import ConsumerMessage

KeyStrategy = Callable[[ConsumerMessage], "str | bytes | None"]

#: headers a dead-letter copy carries so it keeps its original identity
ORIGINAL_TOPIC = "x-original-topic"
ORIGINAL_PARTITION = "x-original-partition"
ORIGINAL_OFFSET = "x-original-offset"
# Spring Kafka's DLT headers: partition is a 4-byte and offset an 8-byte big-endian integer.
SPRING_TOPIC = "kafka_dlt-original-topic"
SPRING_PARTITION = "kafka_dlt-original-partition"
SPRING_OFFSET = "kafka_dlt-original-offset"


def header(*names: str) -> KeyStrategy:
    """The first of the named headers that is present (its bytes are decoded strictly later)."""

    def strategy(message: ConsumerMessage) -> bytes | None:
        for name in names:
            value = message.header(name)
            if value is not None:
                return value
        return None

    strategy.__name__ = f"header({', '.join(names)})"
    return strategy


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidKey("invalid_utf8", f"CloudEvents attribute is not UTF-8: {exc}") from exc


def cloudevents() -> KeyStrategy:
    """CloudEvents identity: ``source`` + ``id`` (an id is unique only within its source).

    Binary mode on Kafka (``ce_id``/``ce_source``) and AMQP (``cloudEvents_id`` or
    ``cloudEvents:id``), or a structured JSON body with ``specversion``, ``id`` and ``source``.
    """

    def strategy(message: ConsumerMessage) -> str | None:
        for prefix in ("ce_", "cloudEvents_", "cloudEvents:"):
            event_id = _text(message.header(prefix + "id"))
            source = _text(message.header(prefix + "source"))
            if event_id and source:
                return f"{source}#{event_id}"
        declared = bool(message.content_type and "cloudevents+json" in message.content_type)
        looks_structured = message.body[:1] == b"{" and b'"specversion"' in message.body
        if declared or looks_structured:
            try:
                event = json.loads(message.body)
            except (ValueError, UnicodeDecodeError, RecursionError):  # not a usable JSON body
                return None
            if isinstance(event, Mapping) and event.get("id") and event.get("source"):
                return f"{event['source']}#{event['id']}"
        return None

    strategy.__name__ = "cloudevents()"
    return strategy


def amqp_message_id() -> KeyStrategy:
    """The AMQP ``message_id`` property, set by the publisher."""

    def strategy(message: ConsumerMessage) -> str | None:
        return message.message_id or None

    strategy.__name__ = "amqp_message_id()"
    return strategy


def _int(value: bytes | None, width: int | None) -> int | None:
    if value is None:
        return None
    if width is not None and len(value) == width:
        return int.from_bytes(value, "big", signed=True)
    try:
        return int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidKey("invalid_coordinates", f"bad original-coordinate header: {exc}") from exc


def original_coordinates(message: ConsumerMessage) -> tuple[str, int, int] | None:
    """The coordinates a dead-letter copy came from (ours or Spring's headers), if any."""
    for topic_h, part_h, off_h, widths in (
        (ORIGINAL_TOPIC, ORIGINAL_PARTITION, ORIGINAL_OFFSET, (None, None)),
        (SPRING_TOPIC, SPRING_PARTITION, SPRING_OFFSET, (4, 8)),
    ):
        topic = message.header(topic_h)
        if topic is None:
            continue
        partition = _int(message.header(part_h), widths[0])
        offset = _int(message.header(off_h), widths[1])
        if partition is None or offset is None:
            raise InvalidKey("invalid_coordinates", f"{topic_h} present without partition/offset")
        return topic.decode("utf-8", errors="strict"), partition, offset
    return None


def kafka_coordinates() -> KeyStrategy:
    """``topic/partition/offset``: unique per record. A dead-letter copy keeps its original
    coordinates, so replaying it cannot run the work a second time."""

    def strategy(message: ConsumerMessage) -> str | None:
        original = original_coordinates(message)
        if original is not None:
            return "{}/{}/{}".format(*original)
        if message.topic is None or message.partition is None or message.offset is None:
            return None
        return f"{message.topic}/{message.partition}/{message.offset}"

    strategy.__name__ = "kafka_coordinates()"
    return strategy


def payload_field(path: str) -> KeyStrategy:
    """A field of the JSON body, by dotted path (``"payment.id"``)."""

    def strategy(message: ConsumerMessage) -> str | None:
        try:
            current: Any = json.loads(message.body)
        except (ValueError, UnicodeDecodeError, RecursionError):  # not a usable JSON body
            return None
        for part in path.split("."):
            if not isinstance(current, Mapping) or part not in current:
                return None
            current = current[part]
        if current is None or isinstance(current, dict | list):
            return None
        return str(current)

    strategy.__name__ = f"payload_field({path})"
    return strategy


def from_callable(fn: Callable[[ConsumerMessage], str | bytes | None]) -> KeyStrategy:
    """Your own function of the message."""
    return fn


def first_of(*strategies: KeyStrategy) -> KeyStrategy:
    """Try each strategy in turn; the first key found wins."""

    def strategy(message: ConsumerMessage) -> str | bytes | None:
        for candidate in strategies:
            found = candidate(message)
            if found is not None:
                return found
        return None

    strategy.__name__ = (
        "first_of(" + ", ".join(getattr(s, "__name__", "?") for s in strategies) + ")"
    )
    return strategy


def describe(strategy: KeyStrategy) -> str:
    return getattr(strategy, "__name__", repr(strategy))
