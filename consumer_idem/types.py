"""The library's value types, in one place: states, decisions, stored records and outcomes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any
from uuid import UUID


class Status(StrEnum):
    """The state of one (scope, key) record. See docs/design.md."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED_RETRYABLE = "failed_retryable"
    UNKNOWN = "unknown"
    EXPIRED = "expired"


class DecisionKind(StrEnum):
    """What a reservation tells the caller to do."""

    EXECUTE = "execute"  #: you own the key (with a token): do the work
    REPLAY = "replay"  #: already done: answer with the stored result
    IN_PROGRESS = "in_progress"  #: someone else holds a live lease: retry after a while
    MISUSE = "misuse"  #: same key, different fingerprint: never a replay
    UNKNOWN = "unknown"  #: may or may not have run: blocked until reconciled


class ResultKind(StrEnum):
    SUCCESS = "success"
    DOMAIN_ERROR = "domain_error"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """An HTTP response kept for byte-for-byte replay."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Record:
    """One row of the store, as read."""

    scope: str
    key: str
    fingerprint: str
    status: Status
    owner_token: UUID | None
    locked_until: datetime | None
    attempts: int
    result_json: str | None  #: the stored result exactly as written (JSON text)
    result_kind: ResultKind | None
    response: StoredResponse | None
    last_error: str | None
    reconcile_after: datetime | None
    reconcile_attempts: int
    reconcile_published_at: datetime | None
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    expires_at: datetime

    @property
    def result(self) -> Any:
        """The stored result, decoded (``None`` when there is none)."""
        return None if self.result_json is None else json.loads(self.result_json)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Record:
        response = None
        if row["http_status"] is not None:
            headers = row["http_headers"]
            if isinstance(headers, str):
                headers = json.loads(headers)
            response = StoredResponse(
                row["http_status"], headers or {}, bytes(row["http_body"] or b"")
            )
        kind = row["result_kind"]
        return cls(
            scope=row["scope"],
            key=row["key"],
            fingerprint=row["fingerprint"],
            status=Status(row["status"]),
            owner_token=row["owner_token"],
            locked_until=row["locked_until"],
            attempts=row["attempts"],
            result_json=row["result"],
            result_kind=ResultKind(kind) if kind else None,
            response=response,
            last_error=row["last_error"],
            reconcile_after=row["reconcile_after"],
            reconcile_attempts=row["reconcile_attempts"],
            reconcile_published_at=row["reconcile_published_at"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            completed_at=row["completed_at"],
            expires_at=row["expires_at"],
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer of [`PostgresStore.reserve`][consumer_idem.PostgresStore.reserve]."""

    kind: DecisionKind
    record: Record
    zombie: bool = False  #: this reservation found an expired lease and parked it as unknown

    @property
    def token(self) -> UUID:
        """The owner token (only for ``execute``): every later write of this attempt needs it."""
        if self.kind is not DecisionKind.EXECUTE or self.record.owner_token is None:
            raise ValueError(f"a {self.kind} decision carries no owner token")
        return self.record.owner_token

    @property
    def retry_after(self) -> float:
        """Seconds until the current owner's lease ends (``in_progress`` only; else 0)."""
        if self.kind is not DecisionKind.IN_PROGRESS or self.record.locked_until is None:
            return 0.0
        remaining = (self.record.locked_until - datetime.now(UTC)).total_seconds()
        return max(0.1, remaining)


class OutcomeKind(StrEnum):
    """What happened to one unit of work, as the transport needs to know it."""

    EXECUTED = "executed"  #: ran now and committed (success or stored domain error)
    REPLAYED = "replayed"  #: a duplicate of completed work: the stored result, not run again
    IN_PROGRESS = "in_progress"  #: another owner is running it: do not ack, retry later
    MISUSE = "misuse"  #: the key was reused with another payload: dead-letter
    UNKNOWN = "unknown"  #: may have run: parked for reconciliation, never re-run blindly
    FAILED_RETRYABLE = "failed_retryable"  #: provably did not run: retry later


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    scope: str
    key: str
    result: Any = None
    result_kind: ResultKind | None = None
    record: Record | None = None
    error: BaseException | None = None
    attempts: int = 0
    retry_after: float = 0.0
    #: this attempt turned a record unknown (Ambiguous, or a lost lease); the caller notifies
    #: the reconciliation topic. False when the record was already unknown before.
    parked_now: bool = False

    @property
    def ackable(self) -> bool:
        """May the transport ack the message now? Everything but in-progress and retryable:
        those must be delivered again."""
        return self.kind not in (OutcomeKind.IN_PROGRESS, OutcomeKind.FAILED_RETRYABLE)


@dataclass(frozen=True, slots=True)
class Executed:
    """Reconciliation answer: the work did happen; store this result."""

    result: Any = None
    result_kind: ResultKind = ResultKind.SUCCESS
    response: StoredResponse | None = None


@dataclass(frozen=True, slots=True)
class NotExecuted:
    """Reconciliation answer: the work provably did not happen; it may run again."""

    reason: str = "reconciled: not executed"


Resolution = Executed | NotExecuted


@dataclass(frozen=True, slots=True)
class Eviction:
    """What an operator's evict removed (``PostgresStore.evict_record``).

    ``redispatch_to`` names the topic or queue the record's original message will be sent to
    again: an ``unknown`` or ``failed_retryable`` record whose delivery was acked (its original
    was kept, or armed by a "not executed" answer) leaves that original armed in the re-dispatch
    outbox, and the sweeper sends it, so the key runs again as the evict promised. ``None``: no
    original was kept, and the broker's redelivery (or a dead-letter replay) runs the key.
    ``held_until``: nothing was evicted, a worker holds the record until then."""

    scope: str
    key: str
    status: Status  #: the status of the record that was deleted (or left held)
    redispatch_to: str | None = None
    #: not evicted: a worker holds the record until then (``in_progress``, lease running)
    held_until: datetime | None = None

    @property
    def evicted(self) -> bool:
        return self.held_until is None
