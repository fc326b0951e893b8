"""Refusing an unsafe FastStream subscriber when its broker starts, before anything is fetched.

The [`Idempotency`][consumer_idem.faststream.Idempotency] middleware settles each delivery itself,
after its commit. A subscriber whose ack policy is anything but ``AckPolicy.MANUAL`` lets
FastStream settle it too: ``ACK_FIRST`` (Kafka's default) commits offsets automatically before
the handler runs, ``ACK`` / ``REJECT_ON_ERROR`` (RabbitMQ's default) / ``NACK_ON_ERROR`` ack or
reject a delivery the middleware left for redelivery. Either loses messages, so the middleware
refuses such a subscriber when the broker starts, not on its first message (by then FastStream
has already committed it).

FastStream (checked with 0.7.8) has no hook for "the broker is about to start" that a
middleware can use, so `guard_start` wraps the ``start`` of the one broker instance the
middleware was given (its class is left alone); the check reads each subscriber's public
``ack_policy`` and, through `consumer_idem.faststream._compat`, the middlewares FastStream
will run for it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from faststream import AckPolicy

from consumer_idem.errors import IdempotencyConfigError
from consumer_idem.faststream._compat import on_subscriber_start, subscriber_middlewares

if TYPE_CHECKING:
    from consumer_idem.faststream import Idempotency

#: the attribute marking a broker whose ``start`` is already guarded
_GUARDED = "_consumer_idem_start_guard"


def unsafe_ack_policy(subscriber: Any) -> str | None:
    """Why ``subscriber``'s ack policy loses messages under the middleware (None: it is safe)."""
    policy = getattr(subscriber, "ack_policy", AckPolicy.MANUAL)
    if policy is AckPolicy.MANUAL:
        return None
    name = getattr(policy, "name", str(policy))
    return (
        f"subscriber {subscriber_name(subscriber)!r} has ack_policy=AckPolicy.{name}: FastStream "
        "would settle its deliveries itself (ACK_FIRST, the Kafka default, commits them before "
        "the handler runs), so a failure or crash would lose messages. Subscribe with "
        "ack_policy=AckPolicy.MANUAL; the Idempotency middleware settles each delivery after "
        "its commit"
    )


def subscriber_name(subscriber: Any) -> str:
    specification = getattr(subscriber, "specification", None)
    name = getattr(specification, "call_name", None)
    return str(name or type(subscriber).__name__)


def _guards(subscriber: Any) -> list[Idempotency]:
    from consumer_idem.faststream import Idempotency

    return [m for m in subscriber_middlewares(subscriber) if isinstance(m, Idempotency)]


def _problems(subscriber: Any, guards: list[Idempotency]) -> list[str]:
    """What loses messages in ``subscriber``'s own configuration (no server asked)."""
    reason = unsafe_ack_policy(subscriber)
    if reason is not None:
        return [reason]
    problems: list[str] = []
    for idem in guards:
        try:
            idem.check_subscriber(subscriber)
            idem.result_types.of(subscriber)  # an unreadable return type: now, not later
        except IdempotencyConfigError as exc:
            problems.append(f"subscriber {subscriber_name(subscriber)!r}: {exc}")
    return problems


def check_subscribers(broker: Any) -> None:
    """Raise [`IdempotencyConfigError`][consumer_idem.IdempotencyConfigError] naming every
    subscriber of ``broker`` run through
    an `Idempotency` middleware that would lose messages."""
    problems: list[str] = []
    for subscriber in getattr(broker, "subscribers", ()):
        guards = _guards(subscriber)
        if guards:
            problems.extend(_problems(subscriber, guards))
    if problems:
        raise IdempotencyConfigError(
            "refusing to start the broker: " + "; ".join(dict.fromkeys(problems))
        )


async def check_subscriber_start(subscriber: Any) -> None:
    """The same checks, and what the server holds (a durable NATS consumer created earlier
    with other settings), for one subscriber as it starts: those the broker starts, and a
    subscriber the application adds and starts later (after ``broker.start()``)."""
    guards = _guards(subscriber)
    if not guards:
        return
    problems = _problems(subscriber, guards)
    if not problems:
        for idem in guards:
            check_server = getattr(idem.transport, "check_server", None)
            if check_server is None:
                continue
            try:
                await check_server(subscriber)
            except IdempotencyConfigError as exc:
                problems.append(f"subscriber {subscriber_name(subscriber)!r}: {exc}")
    if problems:
        raise IdempotencyConfigError(
            "refusing to start the subscriber: " + "; ".join(dict.fromkeys(problems))
        )


def guard_start(idem: Idempotency, broker: Any) -> None:
    """Make ``broker.start()`` refuse unsafe subscribers before it connects or fetches, and
    each subscriber's start (a runtime one too) refuse itself before it fetches."""
    del idem  # every Idempotency on the broker is checked at once
    on_subscriber_start(check_subscriber_start)
    if getattr(broker, _GUARDED, False):
        return
    original: Callable[..., Awaitable[Any]] = broker.start

    @functools.wraps(original)
    async def start(*args: Any, **kwargs: Any) -> Any:
        check_subscribers(broker)
        return await original(*args, **kwargs)

    broker.start = start
    setattr(broker, _GUARDED, True)
