"""An attempt at a key, and how a reservation or a failure reads as an
[`Outcome`][consumer_idem.Outcome]:
shared by both claim phases (`consumer_idem.claim`, `consumer_idem.claim_two_phase`)
and batch mode. Re-exported from ``consumer_idem.claim``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from uuid import UUID

from consumer_idem.types import Decision, DecisionKind, Outcome, OutcomeKind, Record


@dataclass(frozen=True, slots=True)
class Attempt:
    """What a two-phase action knows about its own attempt."""

    scope: str
    key: str
    token: UUID
    number: int  #: 1 for the first attempt, 2 after one failed_retryable, ...

    @property
    def downstream_key(self) -> str:
        """A stable key to pass to the external system (e.g. the gateway's own Idempotency-Key),
        the same on every attempt of this (scope, key), so the far side can dedupe as well."""
        digest = hashlib.sha256(f"{self.scope}\x00{self.key}".encode()).hexdigest()
        return f"ci-{digest[:40]}"


def outcome_of(decision: Decision) -> Outcome:
    """The outcome of a reservation that did not grant execution."""
    record = decision.record
    kind = {
        DecisionKind.REPLAY: OutcomeKind.REPLAYED,
        DecisionKind.IN_PROGRESS: OutcomeKind.IN_PROGRESS,
        DecisionKind.MISUSE: OutcomeKind.MISUSE,
        DecisionKind.UNKNOWN: OutcomeKind.UNKNOWN,
    }[decision.kind]
    return Outcome(
        kind=kind,
        scope=record.scope,
        key=record.key,
        result=record.result if kind is OutcomeKind.REPLAYED else None,
        result_kind=record.result_kind,
        record=record,
        attempts=record.attempts,
        retry_after=decision.retry_after,
        parked_now=decision.zombie,
    )


def failed_outcome(
    record: Record | None,
    scope: str,
    key: str,
    exc: BaseException,
    kind: OutcomeKind,
    parked_now: bool = False,
) -> Outcome:
    return Outcome(
        kind=kind,
        scope=scope,
        key=key,
        record=record,
        error=exc,
        attempts=record.attempts if record else 0,
        parked_now=parked_now,
    )


def error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{code or type(exc).__name__}: {exc}"[:500]
