"""The library's exceptions, all defined here. Every one it raises sits under
[`ConsumerIdemError`][consumer_idem.errors.ConsumerIdemError]::

ConsumerIdemError
├── ConfigurationError (ValueError)  set up so it could not keep its promise (at start-up)
│   ├── WebhookSecretError           a webhook signing secret that cannot work
│   └── IdempotencyConfigError       a FastStream subscriber that cannot be made idempotent
├── InvalidKey (ValueError)          a key or scope the store will not hold
│   └── KeyHeaderError               a malformed ``Idempotency-Key`` header (HTTP 400)
├── InvalidPayload (ValueError)      a body that is not what the consumer declared: poison
├── WebhookVerificationError         a webhook signature that does not verify (400 / 401)
├── StoreUnavailable                 an outage: wait, never proceed unprotected
├── SchemaMissing                    run ``consumer-idem migrate``
├── StoreRejected                    the database refuses the data: dead-letter, do not wait
├── CommitRolledBack                 COMMIT answered ROLLBACK: a handler failure
├── UnstorableResult (TypeError)     a result that cannot be stored as JSON
├── StoredResultMismatch             a stored result that no longer fits the handler's type
├── LeaseLost                        fenced out: the record is no longer this owner's
├── KeyInFlight                      another transaction is claiming the key right now
├── KeyHeld                          an operator's evict of a key a worker holds: refused
├── NotUnknown                       resolve() of a record that is not unknown
├── PublishRefused                   a broker refused a publish for good
├── StreamCutShort                   a streamed HTTP response ended before it was settled
├── NotInTransaction (RuntimeError)  an HTTP request with no idempotency transaction to write in
├── SessionRolledBack                a bound SQLAlchemy session rolled the unit back
├── NoOutbox (RuntimeError)          ``outbox_for(conn)`` where no idempotent unit runs
├── OutboxMessagesLost               a handler ended its unit's transaction with messages pending
└── raised by handlers to classify their outcome:
    Retryable, Ambiguous, DomainError, PoisonMessage

The modules that raise them re-export them (``consumer_idem.http.KeyHeaderError`` is this
``KeyHeaderError``). Only the test kit's simulated broker errors (``testing.PublishFailed``,
``testing.PublishRefusedForGood``) stand outside: they stand for a broker client's own errors.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any


class ConsumerIdemError(Exception):
    """Base class of the library's own errors."""


class ConfigurationError(ConsumerIdemError, ValueError):
    """The library was set up in a way that would not keep its promise (an HTTP middleware that
    cannot see the app's routes, a FastStream subscriber that auto-commits, an empty webhook
    secret). Raised at start-up, not at the first message or request."""


class InvalidKey(ConsumerIdemError, ValueError):
    """The idempotency key (or scope) is empty, too long, not UTF-8 or holds control characters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        #: a short machine-readable reason, used as the dead-letter reason
        self.reason = reason


class StoreUnavailable(ConsumerIdemError):
    """The store could not be reached or failed. Callers must not proceed (fail closed).
    ``said``: the outage is one the store has warned about once for its whole episode (a
    server that cannot take writes), so callers log it per message at debug level only."""

    said: bool = False


class LeaseLost(ConsumerIdemError):
    """The caller's owner token no longer holds the record: the lease expired and the record was
    taken over (parked as ``unknown``, resolved or evicted). The caller must not report an outcome.
    """


class KeyHeaderError(InvalidKey):
    """An ``Idempotency-Key`` header that is not a valid RFC 8941 string or token."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_key_header", message)


class InvalidPayload(ConsumerIdemError, ValueError):
    """The body is not what the consumer declared (e.g. not JSON): a poison message."""


class WebhookVerificationError(ConsumerIdemError):
    """A webhook whose signature does not verify. ``status`` is 400 (malformed) or 401 (wrong or
    stale signature); ``reason`` is the short machine-readable cause."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class WebhookSecretError(ConfigurationError):
    """A signing secret that cannot work: refused when the verifier is built."""


class IdempotencyConfigError(ConfigurationError):
    """A FastStream subscriber configured in a way that cannot be made idempotent."""


class PublishRefused(ConsumerIdemError):
    """A broker refused a publish for good: the same bytes to the same destination will be
    refused again (too large, invalid or unauthorised destination)."""

    def __init__(self, destination: str, cause: BaseException) -> None:
        super().__init__(f"publish to {destination} refused for good: {cause!r}")
        self.destination = destination
        self.cause = cause


class NotInTransaction(ConsumerIdemError, RuntimeError):
    """An HTTP request has no idempotency transaction to write in: it carries no
    Idempotency-Key (make the key ``required`` on the route), its route is two-phase, or it was
    let through unprotected (fail-open)."""


class SessionRolledBack(ConsumerIdemError):
    """The handler's bound SQLAlchemy session rolled back (``session.rollback()``, a failed
    flush): the whole idempotent unit was rolled back with it, and nothing of it committed. The
    delivery is ``failed_retryable`` and runs again."""


class StreamCutShort(ConsumerIdemError):
    """A streamed response's outcome could not be committed (or recorded) after its body was
    sent: its last message is withheld and the response is aborted, so the client sees a
    broken response (an error, as every HTTP client reports one), never a complete one."""


class NoOutbox(ConsumerIdemError, RuntimeError):
    """``outbox_for(conn)`` on a connection that runs no transactional idempotent unit (or, in
    batch mode, without naming the message the outgoing one belongs to): nothing would commit
    the message with an effect, so it is refused instead of being sent unguarded."""


class OutboxMessagesLost(ConsumerIdemError):
    """A handler ended its unit's transaction itself (COMMIT or ROLLBACK on the claim's
    connection) while messages it published through the outbox were pending: they were never
    written, and will never be sent. The error names them (``messages``), the outcome is
    ``unknown`` and the counter ``outbox_lost`` counts them; the key's record stays as the
    handler's COMMIT left it (a redelivery replays it), so the error and the log are where an
    operator finds what to send again."""

    def __init__(self, message: str, messages: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: each lost message: "position N to DESTINATION (idempotency-key K)"
        self.messages = messages


class KeyInFlight(ConsumerIdemError):
    """Another transaction is claiming this key at this very moment (transactional mode with a
    lock timeout): try again shortly."""


class KeyHeld(ConsumerIdemError):
    """An operator's evict of a key a worker holds right now (``in_progress``, time left on its
    lease) was refused and changed nothing: deleted under a running call, a duplicate delivered
    before the call ends would run it again. Wait for the worker, or for its lease to run out
    (``held_until``), and decide then."""

    def __init__(self, scope: str, key: str, held_until: datetime) -> None:
        super().__init__(
            f"({scope!r}, {key!r}) is held by a worker until "
            f"{held_until.isoformat(timespec='seconds')}: nothing evicted (deleted under a "
            "running call, a duplicate delivered before the call ends would run it again)"
        )
        self.scope = scope
        self.key = key
        self.held_until = held_until


class NotUnknown(ConsumerIdemError):
    """``resolve`` was called for a record that is not in the ``unknown`` state."""


# --- outcomes a handler signals by raising ------------------------------------------------------


class Retryable(ConsumerIdemError):
    """The work provably did not take effect (failed before any side effect could start).

    The record becomes ``failed_retryable`` and the next delivery runs the work again.
    """

    def __init__(self, message: str = "retryable failure", *, code: str = "retryable") -> None:
        super().__init__(message)
        self.code = code


class Ambiguous(ConsumerIdemError):
    """The work may or may not have taken effect (e.g. a gateway timed out after the request was
    sent). The record is parked as ``unknown`` for reconciliation and never re-run blindly.
    """

    def __init__(self, message: str = "outcome unknown", *, code: str = "ambiguous") -> None:
        super().__init__(message)
        self.code = code


class DomainError(ConsumerIdemError):
    """A deterministic business failure (card declined, insufficient funds).

    It is stored as the completed result (kind ``domain_error``) and replayed to duplicates,
    exactly like a success: running the work again would give the same answer.
    """

    def __init__(self, result: Any, message: str = "domain error") -> None:
        super().__init__(message)
        self.result = result


class PoisonMessage(ConsumerIdemError):
    """The message can never be processed as it is (a required field is missing, a value is out
    of range). Its transaction rolls back and the delivery is dead-lettered with ``reason`` at
    once, instead of being retried. The key stays free, so a corrected copy can run."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


# --- deterministic failures: never retried as outages --------------------------------------------


class CommitRolledBack(ConsumerIdemError):
    """Postgres answered ``COMMIT`` with ``ROLLBACK``: the transaction had been aborted (a handler
    caught a database error without a savepoint and went on). Nothing of it is in the database;
    it is a handler failure, never an acked or cached success."""


class UnstorableResult(ConsumerIdemError, TypeError):
    """A handler's result cannot be stored as JSON (not serialisable, NaN, a lone surrogate that
    PostgreSQL rejects). Deterministic: running the handler again gives the same result, so the
    delivery is dead-lettered with reason ``unstorable_result`` instead of being retried."""

    reason = "unstorable_result"


class StoredResultMismatch(ConsumerIdemError):
    """A replayed result that no longer validates against the handler's result type (its
    return annotation or ``result_type=``): the model changed since the first run stored it.
    Deterministic: the delivery is dead-lettered with reason ``stored_result_mismatch``; the
    record stays as it is (the effect happened once)."""

    reason = "stored_result_mismatch"

    def __init__(self, scope: str, key: str, expected: str, detail: str) -> None:
        super().__init__(
            f"scope={scope!r} key={key!r}: the stored result is not a valid {expected}: {detail}"
        )
        self.scope = scope
        self.key = key
        self.expected = expected


class SchemaMissing(ConsumerIdemError):
    """The store's schema is missing or older than this library: run ``consumer-idem migrate``.
    A configuration error, not an outage: nothing is retried."""


class StoreRejected(ConsumerIdemError):
    """The store is up but refused the operation for a reason that retrying cannot fix (data
    PostgreSQL will not accept, a constraint of ours violated). Unlike
    [`StoreUnavailable`][consumer_idem.errors.StoreUnavailable]
    it is not waited out: the delivery is dead-lettered with reason ``store_rejected``."""

    reason = "store_rejected"
