"""[`ExternalCall`][consumer_idem.testing.external.ExternalCall]: the handler's call to another
service, as `assert_idempotent`
plays it.

The faults the kit injects at the database and around the handler never show what matters most
to a two-phase handler: a call that *took effect* on the far side (the card was charged) and
then failed on our side (the answer timed out). A handler that turns that failure into
``Retryable`` makes the call again on the retry, and charges twice; one that raises
``Ambiguous`` parks the key ``unknown``, and reconciliation finds the charge. Build your handler
on the calls it makes (a factory taking the client, or the client's method), wrap each in an
``ExternalCall`` in the test, and pass them to ``assert_idempotent(..., external=[...])``: the
kit then makes each call of a delivery, in turn, take effect and raise (one call per delivery).

Outside the kit an ``ExternalCall`` only passes the call through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def _read_timeout() -> BaseException:
    return TimeoutError("assert_idempotent: the call took effect; its answer timed out")


class ExternalCall(Generic[P, T]):
    """Wraps ``call`` (an async function: a fake gateway's or a client's method).

    Awaiting the wrapper awaits ``call``. While `assert_idempotent` has it armed, a call
    the kit picks takes effect (``call`` runs to its end) and then raises ``failure()``
    (default: a ``TimeoutError``; pass e.g. ``lambda: httpx.ReadTimeout("lost")`` for what your
    client raises), as a read timeout after the far side acted does."""

    def __init__(
        self,
        call: Callable[P, Awaitable[T]],
        *,
        failure: Callable[[], BaseException] = _read_timeout,
    ) -> None:
        self.call = call
        self.failure = failure
        self._fails: Callable[[], bool] | None = None
        #: the failures raised after the call took effect, oldest first
        self.raised: list[BaseException] = []

    def arm(self, fails: Callable[[], bool]) -> None:
        """Each call that ends asks ``fails()`` whether it fails (after taking effect). The kit
        counts the calls of a delivery across all its ``ExternalCall``s there, so that each
        call the handler makes, not only its first, is the one that fails in some run."""
        self._fails = fails

    def disarm(self) -> None:
        """Calls pass through again."""
        self._fails = None

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        result = await self.call(*args, **kwargs)
        fails = self._fails
        if fails is not None and fails():
            failure = self.failure()
            self.raised.append(failure)
            raise failure
        return result

    def __repr__(self) -> str:
        return f"ExternalCall({getattr(self.call, '__qualname__', self.call)!r})"
