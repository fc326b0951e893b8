"""The contract every store meets ([`Store`][consumer_idem.stores.base.Store]) and what the stores
share (`StoreBase`).

PostgreSQL is the reference store: it alone joins the handler's transaction (transactional mode,
batch mode, HTTP transactional routes) and keeps the reconciliation outbox. Redis implements the
same state machine for two-phase work, with no transaction to join.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol
from uuid import UUID

from consumer_idem.errors import ConfigurationError
from consumer_idem.keys import normalize_key, validate_scope
from consumer_idem.metrics import Metrics
from consumer_idem.types import Decision, DecisionKind, Record, Resolution, ResultKind

DEFAULT_LEASE = timedelta(seconds=30)
#: consumer scopes: longer than any broker retry or DLQ replay horizon
DEFAULT_RETENTION = timedelta(days=7)
#: HTTP scopes (``http:...``): clients retry a POST for minutes or hours, not days
HTTP_RETENTION = timedelta(hours=24)
HTTP_SCOPE_PREFIX = "http:"

Retention = timedelta | float | Callable[[str], timedelta] | None

_DECISION_COUNTER = {
    DecisionKind.EXECUTE: "created",
    DecisionKind.REPLAY: "replay",
    DecisionKind.IN_PROGRESS: "in_progress",
    DecisionKind.MISUSE: "key_misuse",
    DecisionKind.UNKNOWN: "unknown",
}


def seconds(value: timedelta | float) -> timedelta:
    """Durations are accepted as ``timedelta`` or seconds."""
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


#: the longest retention (and lease): an expiry PostgreSQL cannot date (past the year 294276)
#: fails every claim with "timestamp out of range", a data exception, so a longer one is
#: refused at set-up rather than taken for bad data in each message
MAX_RETENTION = timedelta(days=3_652_425)  # 10,000 years: "for ever" for any record


def checked_duration(value: timedelta | float, name: str = "retention") -> timedelta:
    """``value`` (a retention or a lease) as a duration, or a
    [`ConfigurationError`][consumer_idem.ConfigurationError] when
    no record could be dated that far ahead (``timedelta.max`` meaning "for ever", say)."""
    duration = seconds(value)
    if duration > MAX_RETENTION:
        raise ConfigurationError(
            f"{name}={value!r} is longer than PostgreSQL can date a record's expiry: every "
            f"claim would fail. For ever is {name}=consumer_idem.MAX_RETENTION "
            f"({MAX_RETENTION.days} days)"
        )
    return duration


def default_retention(scope: str) -> timedelta:
    """7 days for consumer scopes, 24 hours for HTTP scopes (``http:`` prefix). Webhook scopes
    should outlive the provider's retry horizon: pass your own policy for them."""
    return HTTP_RETENTION if scope.startswith(HTTP_SCOPE_PREFIX) else DEFAULT_RETENTION


class Store(Protocol):
    """What every store offers: the reservation state machine and its owner transitions.

    Two-phase execution ([`run_two_phase`][consumer_idem.execution.run_two_phase], two-phase
    consumers and
    webhooks) runs on any ``Store``; transactional mode needs
    [`PostgresStore`][consumer_idem.PostgresStore].
    """

    lease: timedelta
    metrics: Metrics

    def check(self, scope: str, key: str | bytes) -> tuple[str, str]: ...

    def retention_for(self, scope: str, override: timedelta | float | None = None) -> timedelta: ...

    async def migrate(self) -> list[int]: ...

    async def reserve(
        self,
        scope: str,
        key: str | bytes,
        fingerprint: str,
        *,
        lease: timedelta | float | None = None,
        retention: timedelta | float | None = None,
    ) -> Decision: ...

    async def complete(
        self,
        scope: str,
        key: str,
        token: UUID,
        result: Any = None,
        *,
        result_kind: ResultKind = ResultKind.SUCCESS,
        retention: timedelta | float | None = None,
    ) -> Record: ...

    async def fail_retryable(
        self, scope: str, key: str, token: UUID, error: str = ...
    ) -> Record: ...

    async def mark_unknown(self, scope: str, key: str, token: UUID, error: str = ...) -> Record: ...

    async def resolve(
        self,
        scope: str,
        key: str,
        resolution: Resolution,
        *,
        retention: timedelta | float | None = None,
    ) -> Record: ...

    async def get(self, scope: str, key: str) -> Record | None: ...

    async def evict(self, scope: str, key: str, *, token: UUID | None = None) -> bool: ...


class StoreBase:
    """What both stores do the same way: key and scope checks, retention, decision counters."""

    def __init__(
        self,
        *,
        lease: timedelta | float,
        retention: Retention,
        metrics: Metrics | None,
        hash_invalid_keys: bool,
    ) -> None:
        self.lease = checked_duration(lease, "lease")
        if retention is None:
            self._retention: Callable[[str], timedelta] = default_retention
        elif callable(retention):
            self._retention = retention
        else:
            fixed = checked_duration(retention)
            self._retention = lambda scope: fixed
        self.metrics = metrics or Metrics()
        self.hash_invalid_keys = hash_invalid_keys

    def retention_for(self, scope: str, override: timedelta | float | None = None) -> timedelta:
        """How long a record of ``scope`` is kept after it was last written."""
        return checked_duration(self._retention(scope) if override is None else override)

    def check(self, scope: str, key: str | bytes) -> tuple[str, str]:
        """Validate scope and key (raises InvalidKey); returns them as stored."""
        return validate_scope(scope), self.check_key(key)

    def check_key(self, key: str | bytes) -> str:
        """Validate a key of a scope checked already (raises InvalidKey); returns it as stored."""
        return normalize_key(key, hash_invalid=self.hash_invalid_keys)

    def count_decision(self, decision: Decision, scope: str) -> None:
        """One counter per reservation decision, plus ``zombie`` for a lease found expired."""
        self.metrics.inc(_DECISION_COUNTER[decision.kind], scope)
        if decision.zombie:
            self.metrics.inc("zombie", scope)
