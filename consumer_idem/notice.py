"""Reconciliation notices: what is published when a key is parked as ``unknown``.

The ``unknown`` row is the source of truth; a notice only says where to look (scope, key), and,
when the delivery that parked it had the message in hand, carries that message and where it came
from, so a "not executed" answer can re-dispatch it to run once.

A re-dispatched copy must run under the *same* idempotency key as its original, whatever the
consumer's key strategy reads. So the original travels whole: its body and headers, the Kafka
record key (the copy lands on the same partition, and a ``header``/``payload`` key is unchanged),
its coordinates as ``x-original-topic/-partition/-offset`` headers when it has none yet (so
``kafka_coordinates()`` yields the original's key for the copy too), and the AMQP properties
(``message_id`` for ``amqp_message_id()``, ``correlation_id``, ``content_type``, ``type``...).
The same `Notice` is what the re-dispatch outbox keeps. Notices written before these
fields existed still decode (without them).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from consumer_idem.key_strategies import (
    ORIGINAL_OFFSET,
    ORIGINAL_PARTITION,
    ORIGINAL_TOPIC,
    SPRING_TOPIC,
)
from consumer_idem.message import ConsumerMessage

SCOPE_HEADER = "x-consumer-idem-scope"
KEY_HEADER = "x-consumer-idem-key"
#: the queue a RabbitMQ dead-letter copy first came from
ORIGINAL_QUEUE = "x-original-queue"

#: AMQP properties a notice carries and a re-dispatch restores. Not ``expiration`` (a re-dispatch
#: must not be dropped unseen), not ``user_id`` (the broker refuses one that is not the
#: publishing connection's user), not ``delivery_mode`` (re-dispatches are always persistent).
AMQP_PROPERTIES: dict[str, type] = {
    "message_id": str,
    "correlation_id": str,
    "content_type": str,
    "content_encoding": str,
    "type": str,
    "app_id": str,
    "reply_to": str,
    "priority": int,
    "timestamp": float,  #: seconds since the epoch
}


@dataclass(frozen=True, slots=True)
class Notice:
    scope: str
    key: str
    reason: str | None = None
    #: topic or queue the original message came from (None if it was not in hand)
    source: str | None = None
    body: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    #: the original's Kafka record key (None: it had none, or the notice predates this field)
    record_key: bytes | None = None
    #: the original's AMQP properties (see :data:`AMQP_PROPERTIES`)
    properties: dict[str, Any] = field(default_factory=dict)

    @property
    def original(self) -> bool:
        """Whether the notice carries the original message (so it can be re-dispatched)."""
        return self.source is not None and self.body is not None


@dataclass(frozen=True, slots=True)
class PendingRedispatch:
    """A row of the re-dispatch outbox: a "not executed" answer whose original message has not
    been confirmed sent yet (the sweeper sends it)."""

    id: int
    notice: Notice
    attempts: int = 0
    last_error: str | None = None
    #: False for an original kept for a record not resolved yet (held, never sent)
    armed: bool = True


def clean_properties(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    """The known AMQP properties of ``properties`` that are set, in their JSON form."""
    clean: dict[str, Any] = {}
    for name, kind in AMQP_PROPERTIES.items():
        value = (properties or {}).get(name)
        if value is None or value == "":
            continue
        if kind is float and hasattr(value, "timestamp"):  # a datetime
            value = value.timestamp()
        try:
            clean[name] = kind(value)
        except (TypeError, ValueError):
            continue  # a property we cannot carry is dropped, never guessed
    return clean


def original_headers(original: ConsumerMessage) -> dict[str, bytes]:
    """The headers a re-dispatch of ``original`` carries: its own (not the broker's delivery
    count), plus its Kafka coordinates as ``x-original-*`` unless it already has original
    coordinates (a dead-letter copy, or an earlier re-dispatch)."""
    headers = {k: v for k, v in original.headers.items() if not k.startswith("x-delivery")}
    has_origin = any(original.header(name) is not None for name in (ORIGINAL_TOPIC, SPRING_TOPIC))
    if (
        not has_origin
        and original.topic is not None
        and original.partition is not None
        and original.offset is not None
    ):
        headers[ORIGINAL_TOPIC] = original.topic.encode()
        headers[ORIGINAL_PARTITION] = str(original.partition).encode()
        headers[ORIGINAL_OFFSET] = str(original.offset).encode()
    return headers


def make_notice(
    scope: str,
    key: str,
    reason: str | None,
    *,
    source: str | None = None,
    original: ConsumerMessage | None = None,
    properties: Mapping[str, Any] | None = None,
) -> Notice:
    """The notice of ``scope``/``key``; with ``original`` and ``source``, carrying the original
    message whole (see the module docstring). ``properties``: the AMQP properties of the
    original, if it came from RabbitMQ (``message_id`` and ``content_type`` are also taken from
    ``original`` when not given)."""
    if original is None or source is None:
        return Notice(scope, key, reason)
    props = clean_properties(
        {"message_id": original.message_id, "content_type": original.content_type}
        | dict(properties or {})
    )
    return Notice(
        scope,
        key,
        reason,
        source=source,
        body=original.body,
        headers=original_headers(original),
        record_key=original.record_key,
        properties=props,
    )


def encode(notice: Notice) -> bytes:
    doc: dict[str, Any] = {"scope": notice.scope, "key": notice.key, "reason": notice.reason}
    if notice.original:
        assert notice.body is not None
        doc["source"] = notice.source
        doc["body_b64"] = base64.b64encode(notice.body).decode()
        doc["headers_b64"] = {k: base64.b64encode(v).decode() for k, v in notice.headers.items()}
        if notice.record_key is not None:
            doc["record_key_b64"] = base64.b64encode(notice.record_key).decode()
        if notice.properties:
            doc["properties"] = notice.properties
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_notice(
    scope: str,
    key: str,
    reason: str | None,
    *,
    source: str | None = None,
    original: ConsumerMessage | None = None,
    properties: Mapping[str, Any] | None = None,
) -> bytes:
    """`make_notice`, encoded as JSON (what is published)."""
    return encode(
        make_notice(scope, key, reason, source=source, original=original, properties=properties)
    )


def decode_notice(message: ConsumerMessage) -> Notice:
    """Raises ``ValueError`` for something that is not a notice."""
    doc = message.json()
    if not isinstance(doc, dict) or not doc.get("scope") or not doc.get("key"):
        raise ValueError("a reconciliation notice needs scope and key")
    body = doc.get("body_b64")
    headers = doc.get("headers_b64") or {}
    record_key = doc.get("record_key_b64")
    properties = doc.get("properties")
    return Notice(
        scope=str(doc["scope"]),
        key=str(doc["key"]),
        reason=doc.get("reason"),
        source=doc.get("source"),
        body=base64.b64decode(body) if body is not None else None,
        headers={str(k): base64.b64decode(v) for k, v in headers.items()},
        record_key=base64.b64decode(record_key) if record_key is not None else None,
        properties=clean_properties(properties if isinstance(properties, dict) else None),
    )
