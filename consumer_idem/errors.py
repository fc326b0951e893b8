"""Every exception the library raises or asks handlers to raise, in one place."""

from __future__ import annotations

from typing import Any


class ConsumerIdemError(Exception):
    """Base class of the library's own errors."""


class InvalidKey(ConsumerIdemError, ValueError):
    """The idempotency key (or scope) is empty, too long, not UTF-8 or holds control characters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        #: a short machine-readable reason, used as the dead-letter reason
        self.reason = reason


class StoreUnavailable(ConsumerIdemError):
    """The store could not be reached or failed. Callers must not proceed (fail closed)."""


class LeaseLost(ConsumerIdemError):
    """The caller's owner token no longer holds the record: the lease expired and the record was
    taken over (parked as ``unknown``, resolved or evicted). The caller must not report an outcome.
    """


class KeyInFlight(ConsumerIdemError):
    """Another transaction is claiming this key at this very moment (transactional mode with a
    lock timeout): try again shortly."""


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
