"""The reconcile step of [`assert_idempotent`][consumer_idem.testing.assert_idempotent].

A scenario may leave a record ``unknown`` (two-phase ambiguity, a lost lease). The kit settles
it as an operator's [`Reconciler`][consumer_idem.operations.reconcile.Reconciler] would, with the
user's resolver or, without one, a resolver that reads the truth from ``effect()``; a "not
executed" answer re-sends the original, which is delivered again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import encode_notice
from consumer_idem.operations.reconcile import Reconciler, Resolver
from consumer_idem.testing.broker import MemoryTransport, deliver
from consumer_idem.testing.expectations import Expectations, NotIdempotent, story
from consumer_idem.types import Executed, NotExecuted, Record, Status

Redeliver = Callable[[list[ConsumerMessage]], Awaitable[object]]


async def reconcile(
    name: str,
    message: ConsumerMessage,
    key: str,
    *,
    expect: Expectations,
    resolver: Resolver | None,
    redeliver: Redeliver,
) -> None:
    """Settle a record left ``unknown`` as the reconciler would; a "not executed" answer
    re-sends the original, which is delivered again."""
    plain, scope = expect.plain, expect.scope
    for _ in range(3):
        record = await plain.get(scope, key)
        if record is None or record.status is not Status.UNKNOWN:
            return
        transport = MemoryTransport(plain)
        writes = expect.consumer.local_writes
        reconciler = Reconciler(
            plain,
            resolver or truth(expect, message, key),
            backoff=(0.01, 0.05),
            redispatch_grace=0.0,
            # as an operator's reconciler must: "executed" commits the local rows too
            local_writes=None if writes is None else {scope: writes},
        )
        reconciler.attach(transport)
        notice = ConsumerMessage(encode_notice(scope, key, record.last_error))
        await deliver(reconciler.process, notice, transport=transport)
        copies = [
            ConsumerMessage(n.body, dict(n.headers))
            for n in transport.redispatched
            if n.body is not None
        ]
        record = await plain.get(scope, key)
        if record is not None and record.status is Status.FAILED_RETRYABLE and not copies:
            copies = [message.fresh()]  # nothing kept to re-send: the broker redelivers it
        for copy in copies:
            await redeliver([copy])
    record = await plain.get(scope, key)
    raise NotIdempotent(name, f"still unknown after reconciliation: {story(None, record)}")


def truth(expect: Expectations, message: ConsumerMessage, key: str) -> Resolver:
    """A resolver that knows the truth: "executed" when ``effect()`` shows the effect, "not
    executed" when it shows what it did before the delivery."""

    async def resolve(record: Record) -> Executed | NotExecuted:
        if await expect.effect_of(message) == expect.before[key]:
            return NotExecuted("assert_idempotent: effect() shows no effect")
        return Executed(None)

    return resolve
