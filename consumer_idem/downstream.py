"""The key a two-phase handler passes to the far side, computed from (scope, key) alone.

A reconciliation resolver asks the gateway about the charge under this key; it lives here,
outside the HTTP module, so a Kafka- or RabbitMQ-only app needs no web framework for it.
"""

from __future__ import annotations

import uuid

from consumer_idem.claim import Attempt


def downstream_key_for(scope: str, key: str) -> str:
    """The two-phase ``downstream_key`` of (scope, key): the same on every attempt, and for a
    run fail-open let through unprotected (``Attempt.downstream_key``)."""
    return Attempt(scope, key, uuid.UUID(int=0), 0).downstream_key
