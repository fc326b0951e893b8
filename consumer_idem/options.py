"""The options every consumer entry point shares, defined once.

[`ConsumerOptions`][consumer_idem.options.ConsumerOptions] is the one definition (types, defaults,
checks).
``@idempotent_consumer``, [`IdempotentConsumer`][consumer_idem.consumer.IdempotentConsumer] and
FastStream's
[`Idempotency`][consumer_idem.faststream.Idempotency] all take it, or its fields as keyword
arguments
(`ConsumerArgs` types them for those signatures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal, TypedDict

from consumer_idem.execution import LocalWrites
from consumer_idem.key_strategies import KeyStrategy, amqp_message_id, cloudevents, first_of, header
from consumer_idem.result_types import FROM_ANNOTATION
from consumer_idem.stores.base import checked_duration
from consumer_idem.verdict_hooks import VerdictHook

Mode = Literal["transactional", "two_phase"]
Payload = Literal["json", "bytes"]
OnInvalidKey = Literal["dead_letter", "raise"]

#: Tried in order when no ``key=`` is given: an ``idempotency-key`` header, a CloudEvents id, the
#: AMQP message id. Kafka coordinates are deliberately not a default: a producer's retry is a
#: new record at a new offset, so it would never be caught as a duplicate.
DEFAULT_KEY = first_of(header("idempotency-key"), cloudevents(), amqp_message_id())


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerOptions:
    """How a handler is made idempotent. Every field but ``scope`` has a default.

    * ``scope``: the namespace of the keys (one per handler, e.g. ``payments.ledger``).
    * ``key``: a key strategy (see ``consumer_idem.key_strategies``); a message without a valid
      key is dead-lettered with the reason, or raises with ``on_invalid_key="raise"``.
    * ``mode``: ``"transactional"`` (the handler writes on the connection of the idempotency
      transaction) or ``"two_phase"`` (external I/O under a lease).
    * ``batch``: transactional only; one transaction for a whole fetched run of messages.
    * ``payload``: ``"json"`` (a body that is not JSON is dead-lettered as ``invalid_json``;
      the fingerprint is RFC 8785 canonical JSON) or ``"bytes"``.
    * ``fingerprint_fields``: fingerprint only these top-level JSON fields.
    * ``local_writes``: two-phase only; ``local_writes(conn, result)`` commits local rows with
      the completion.
    * ``max_attempts``: retries of provably-not-executed failures before dead-lettering.
    * ``lease`` / ``retention``: override the store's lease and retention for this scope.
    * ``backoff``: (base, cap) seconds of the jittered exponential retry delay.
    * ``result_type``: the type a replayed result is read back as (default: the handler's
      return annotation; ``None``: the decoded JSON). See `consumer_idem.result_types`.
    * ``on_execute`` / ``on_replay``: ``callback(verdict)``, called (synchronously) with the
      verdict of each delivery whose handler ran and committed / that replayed a stored
      result: for metrics and headers. An exception it raises is logged, not the delivery's.
    """

    scope: str
    key: KeyStrategy = DEFAULT_KEY
    mode: Mode = "transactional"
    batch: bool = False
    payload: Payload = "json"
    fingerprint_fields: Sequence[str] | None = None
    local_writes: LocalWrites | None = None
    max_attempts: int = 5
    lease: timedelta | float | None = None
    retention: timedelta | float | None = None
    on_invalid_key: OnInvalidKey = "dead_letter"
    backoff: tuple[float, float] = (0.2, 30.0)
    result_type: Any = FROM_ANNOTATION
    on_execute: VerdictHook | None = None
    on_replay: VerdictHook | None = None

    def __post_init__(self) -> None:
        if self.batch and self.mode != "transactional":
            raise ValueError(
                "batch mode commits many messages in one transaction: transactional only"
            )
        if self.local_writes is not None and self.mode != "two_phase":
            raise ValueError(
                "local_writes belongs to two-phase mode (transactional handlers write on conn)"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if self.retention is not None:
            checked_duration(self.retention)
        if self.lease is not None:
            checked_duration(self.lease, "lease")
        if self.fingerprint_fields is not None:  # a list given by the caller is frozen here
            object.__setattr__(self, "fingerprint_fields", tuple(self.fingerprint_fields) or None)


class ConsumerArgs(TypedDict, total=False):
    """The fields of [`ConsumerOptions`][consumer_idem.options.ConsumerOptions] other than
    ``scope``, ``mode`` and ``batch``, as
    typed keyword arguments (``**options: Unpack[ConsumerArgs]``). A test keeps the two in step."""

    key: KeyStrategy
    payload: Payload
    fingerprint_fields: Sequence[str] | None
    local_writes: LocalWrites | None
    max_attempts: int
    lease: timedelta | float | None
    retention: timedelta | float | None
    on_invalid_key: OnInvalidKey
    backoff: tuple[float, float]
    result_type: Any
    on_execute: VerdictHook | None
    on_replay: VerdictHook | None


def option_names() -> set[str]:
    """The names [`ConsumerOptions`][consumer_idem.options.ConsumerOptions] takes (for the check
    that `ConsumerArgs`
    lists the same)."""
    return {f.name for f in fields(ConsumerOptions)}
