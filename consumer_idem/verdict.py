"""What a transport must do with one delivery: the [`Verdict`][consumer_idem.verdict.Verdict] the
consumer gives, and the
small contracts between the consumer and the runners (`CommitHook`, `Processor`).
Re-exported from ``consumer_idem.consumer``, where they were first defined."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import encode_notice
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Outcome, OutcomeKind

#: headers a dead-lettered copy carries (both transports)
DEAD_LETTER_REASON = "x-dead-letter-reason"
DEAD_LETTER_SCOPE = "x-dead-letter-scope"
DEAD_LETTER_KEY = "x-dead-letter-key"
DEAD_LETTER_ERROR = "x-dead-letter-error"


class Action(StrEnum):
    ACK = "ack"  #: the effect is durable (or never to happen): ack / commit the offset
    RETRY = "retry"  #: do not ack; deliver this message again after ``retry_after`` seconds
    DEAD_LETTER = "dead_letter"  #: publish to the dead-letter destination with ``reason``, then ack


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the transport must do with one delivery."""

    action: Action
    scope: str
    key: str | None = None
    outcome: Outcome | None = None
    reason: str | None = None
    retry_after: float = 0.0
    #: publish a reconciliation notice (durably) before acking: this delivery parked the key
    reconcile: bool = False
    #: a duplicate absorbed without running the handler
    duplicate: bool = False
    #: for a dead letter: the error text behind ``reason`` (goes into the dead-letter headers)
    error: str | None = None
    #: the span context of the delivery's span (``consumer_idem.tracing``): settling continues it
    trace_context: Any = field(default=None, compare=False, repr=False)

    @property
    def result(self) -> Any:
        return None if self.outcome is None else self.outcome.result


def reconcile_notice(
    verdict: Verdict,
    original: ConsumerMessage | None = None,
    source: str | None = None,
    properties: Mapping[str, Any] | None = None,
) -> bytes:
    """The reconciliation notice of a verdict about an ``unknown`` key (see ``notice.py``);
    with ``original`` and ``source``, carrying the original message whole (``properties``: its
    AMQP properties)."""
    assert verdict.key is not None
    return encode_notice(
        verdict.scope,
        verdict.key,
        notice_reason(verdict),
        source=source,
        original=original,
        properties=properties,
    )


def notice_reason(verdict: Verdict) -> str | None:
    """Why a key is ``unknown``, as its notice says: the record's last error, else the verdict's
    reason."""
    record = verdict.outcome.record if verdict.outcome is not None else None
    return (record.last_error if record else None) or verdict.reason


class CommitHook(Protocol):
    """A runner's own record of progress, committed with the deliveries it covers: the Kafka
    runner's consumed offset (``KafkaRunner(offsets_in_postgres=True)``). Transactional mode
    only; the consumer adds it to a transaction only while every delivery of the run up to
    that one is settled by the commit alone (executed, or a plain duplicate): never past one
    that still has a dead letter, a notice or an original to publish or keep."""

    def statement(self, upto: ConsumerMessage) -> str:
        """SQL (simple protocol, no parameters) recording that the run is settled up to and
        including ``upto``."""
        ...

    def committed(self, upto: ConsumerMessage) -> None:
        """The transaction carrying `statement` for ``upto`` has committed."""
        ...


def settled_by_commit(verdict: Verdict) -> bool:
    """Whether the transport only has to ack this verdict: nothing to publish or keep first
    (a dead letter, a reconciliation notice, the original of an ``unknown`` outcome)."""
    outcome = verdict.outcome
    return (
        verdict.action is Action.ACK
        and not verdict.reconcile
        and (outcome is None or outcome.kind is not OutcomeKind.UNKNOWN)
    )


class Processor(Protocol):
    """What a transport runner drives: an [`IdempotentConsumer`][consumer_idem.IdempotentConsumer],
    or the reconciler."""

    store: PostgresStore
    scope: str
    batch: bool

    # plain defs returning awaitables: a wrapped (traced) coroutine function matches as well
    def process(self, message: ConsumerMessage) -> Awaitable[Verdict]: ...

    def process_batch(self, messages: Sequence[ConsumerMessage]) -> Awaitable[list[Verdict]]: ...


def error_text(exc: BaseException) -> str:
    """An error as the dead-letter headers carry it."""
    return f"{type(exc).__name__}: {exc}"[:1000]
