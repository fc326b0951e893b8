"""The transport-neutral view of one delivered message, built by each transport's runner."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from consumer_idem.errors import InvalidPayload

_UNDECODED: Any = object()


@dataclass(frozen=True, slots=True)
class ConsumerMessage:
    """One delivery. Header values are bytes as received (Kafka) or encoded to UTF-8 (AMQP)."""

    body: bytes
    headers: Mapping[str, bytes] = field(default_factory=dict)
    #: AMQP ``message_id`` property (never FastStream's generated id)
    message_id: str | None = None
    #: Kafka coordinates of this delivery
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    #: Kafka record key
    record_key: bytes | None = None
    #: broker redelivery count when the broker keeps one (``x-delivery-count`` on quorum queues)
    delivery_count: int | None = None
    content_type: str | None = None
    #: the transport's own message object (aiokafka ConsumerRecord, aio-pika IncomingMessage)
    raw: Any = None
    # the decoded body, kept after the first json() call (fingerprint and handler both need it)
    _decoded: Any = field(default=_UNDECODED, repr=False, compare=False)
    # (consumer, its ``prepare`` answer): kept so a runner can prepare a message ahead, while
    # the previous batch's transaction is in flight (derived from the bytes, never stale)
    _prepared: Any = field(default=None, repr=False, compare=False)

    def json(self) -> Any:
        """The body decoded as JSON (decoded once); raises
        [`InvalidPayload`][consumer_idem.InvalidPayload] if it is not
        JSON. Treat the value as read-only: it is shared by every caller."""
        if self._decoded is _UNDECODED:
            try:
                value = json.loads(self.body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise InvalidPayload(f"body is not valid JSON: {exc}") from exc
            except RecursionError as exc:  # nested deeper than Python can decode
                raise InvalidPayload("body is JSON nested too deeply to decode") from exc
            object.__setattr__(self, "_decoded", value)
        return self._decoded

    def fresh(self) -> ConsumerMessage:
        """This delivery with its decoded body forgotten: a new attempt after a rolled-back one
        must not see the in-place changes the failed attempt made to the shared value."""
        return replace(self, _decoded=_UNDECODED)

    def header(self, name: str) -> bytes | None:
        """A header's raw value (header names are matched case-insensitively)."""
        value = self.headers.get(name)
        if value is not None:
            return value
        lowered = name.lower()
        for key, candidate in self.headers.items():
            if key.lower() == lowered:
                return candidate
        return None


def header_bytes(value: Any) -> bytes:
    """AMQP header values arrive as str, bytes, numbers...: keep one representation (bytes)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return str(value).encode("utf-8")
