"""The handler's external calls under
[`assert_idempotent`][consumer_idem.testing.assert_idempotent].

The kit arms each [`ExternalCall`][consumer_idem.testing.ExternalCall] to count the calls a delivery
makes; in "the call took effect, then failed" it makes the n-th of them take effect and then
raise, notes what the handler made of that, and watches the handler's next run: it must make
its call again (for the far side to answer it), not answer from a memory the kit cannot see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from consumer_idem.testing.external import ExternalCall

Handler = Callable[..., Awaitable[Any]]


class ExternalFaults:
    def __init__(self, calls: list[ExternalCall[..., Any]], events: list[str]) -> None:
        self.calls = calls
        #: faults and injections fired, in order (shared with the kit)
        self.events = events
        #: external calls one clean delivery made, and which one fails in this run (1-based)
        self.clean_calls = 0
        self.calls_made = 0
        self.fail_call = 1
        #: this scenario run's external call took effect and failed (later runs are watched)
        self.fired = False
        #: what the handler made of its call's failure after it took effect (the exception it
        #: raised, or "returned normally"), for the message of a scenario that then fails
        self.after: str | None = None

    def reset(self) -> None:
        """A new scenario run: nothing fired yet."""
        self.after = None
        self.fired = False

    def arm(self, fails: Callable[[], bool]) -> None:
        self.calls_made = 0

        def counted() -> bool:
            self.calls_made += 1
            return fails()

        for call in self.calls:
            call.arm(counted)

    def disarm(self) -> None:
        for call in self.calls:
            call.disarm()

    async def took_effect(self, handler: Handler, work: Any, context: Any) -> Any:
        """Run the handler with its external calls armed: its ``fail_call``-th call takes
        effect, then raises (only that one). Note what the handler made of it."""
        self.arm(lambda: self.calls_made == self.fail_call)
        fired = [len(call.raised) for call in self.calls]

        def took_effect() -> bool:
            return any(len(c.raised) > n for c, n in zip(self.calls, fired, strict=True))

        try:
            result = await handler(work, context)
        except BaseException as exc:
            if took_effect():
                self.after = f"raised {type(exc).__name__}({exc})"
            raise
        finally:
            self.disarm()
            if took_effect():
                self.fired = True
                failure = next(
                    c.raised[-1]
                    for c, n in zip(self.calls, fired, strict=True)
                    if len(c.raised) > n
                )
                nth = self.fail_call, self.clean_calls
                self.events.append(
                    f"the call took effect, then raised {type(failure).__name__}"
                    + ("" if nth[1] <= 1 else f" (call {nth[0]} of the {nth[1]} a delivery makes)")
                )
        self.after = "returned normally"
        return result

    async def after_took_effect(self, handler: Handler, work: Any, context: Any) -> Any:
        """Run the handler again after its call took effect and failed, counting its calls
        (`forgotten` then says whether it made none)."""
        self.arm(lambda: False)
        try:
            return await handler(work, context)
        finally:
            self.disarm()

    def forgotten(self) -> str | None:
        """The handler ran again after its call took effect and failed: it said the work was
        not done (``Retryable``), so it must make its call again, for the far side to answer
        it (a gateway deduping by ``attempt.downstream_key``). Answering without any call
        means it remembered the first one where the kit cannot see: process memory, which a
        redelivery to another instance (a restart, a rebalance) does not have, and the call is
        made twice there. The detail of that finding, or None."""
        if self.calls_made != 0 or self.clean_calls <= 0:
            return None
        return (
            f"the external call took effect and then failed; the handler "
            f"{self.after}, and when the message was delivered again it returned "
            f"without making any of the {self.clean_calls} call(s) one clean delivery makes: "
            "it remembered the first attempt where the kit cannot see (process memory?). A "
            "redelivery to another instance (a restart, a rebalance) makes the call again "
            "(if it asked the far side, wrap that call in an ExternalCall too). "
            "An error after a call may have taken effect is Ambiguous (the key is parked "
            "unknown and reconciled), never Retryable, unless the far side dedupes it by "
            "attempt.downstream_key"
        )

    def hint(self, two_phase: bool) -> str:
        """Why a handler fails "the call took effect, then failed", in its own terms."""
        if self.after is None:
            return ""
        told = (
            f". The external call took effect and then failed; the handler "
            f"{self.after}, and the call was made again"
        )
        if not two_phase:
            return (
                f"{told}: a transactional handler's call to another service is not rolled back "
                "with its unit (make it a two-phase handler)"
            )
        return (
            f"{told}. An error after a call may have taken effect is Ambiguous (the key is "
            "parked unknown and reconciled), never Retryable, unless the far side dedupes it "
            "by attempt.downstream_key"
        )
