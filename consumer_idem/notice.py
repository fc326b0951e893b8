"""Reconciliation notices: what is published when a key is parked as ``unknown``.

The ``unknown`` row is the source of truth; a notice only says where to look (scope, key), and,
when the delivery that parked it had the message in hand, carries that message and where it came
from, so a "not executed" answer can re-dispatch it to run once.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from consumer_idem.message import ConsumerMessage

SCOPE_HEADER = "x-consumer-idem-scope"
KEY_HEADER = "x-consumer-idem-key"


@dataclass(frozen=True, slots=True)
class Notice:
    scope: str
    key: str
    reason: str | None = None
    #: topic or queue the original message came from (None if it was not in hand)
    source: str | None = None
    body: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)


def encode_notice(
    scope: str,
    key: str,
    reason: str | None,
    *,
    source: str | None = None,
    original: ConsumerMessage | None = None,
) -> bytes:
    doc: dict[str, Any] = {"scope": scope, "key": key, "reason": reason}
    if original is not None and source is not None:
        doc["source"] = source
        doc["body_b64"] = base64.b64encode(original.body).decode()
        doc["headers_b64"] = {
            k: base64.b64encode(v).decode()
            for k, v in original.headers.items()
            if not k.startswith("x-delivery")
        }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_notice(message: ConsumerMessage) -> Notice:
    """Raises ``ValueError`` for something that is not a notice."""
    doc = message.json()
    if not isinstance(doc, dict) or not doc.get("scope") or not doc.get("key"):
        raise ValueError("a reconciliation notice needs scope and key")
    body = doc.get("body_b64")
    headers = doc.get("headers_b64") or {}
    return Notice(
        scope=str(doc["scope"]),
        key=str(doc["key"]),
        reason=doc.get("reason"),
        source=doc.get("source"),
        body=base64.b64decode(body) if body is not None else None,
        headers={str(k): base64.b64decode(v) for k, v in headers.items()},
    )
