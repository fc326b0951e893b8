"""A NATS pull subscriber's fetch that never drops the messages it already holds.

FastStream's batch pull loop (checked with FastStream 0.7.8, nats-py 2.16.0) gathers a batch
with several ``fetch`` calls and hands what it gathered to the handler when a fetch times out,
catching nats-py's ``nats.errors.TimeoutError``. But nats-py's ``fetch`` of several messages
sometimes raises the plain ``asyncio.TimeoutError`` instead: when the server's "request
timeout" status for its no-wait probe reaches the client just before the client's own timer
does. That error escapes the loop, FastStream restarts the loop, and the messages already
gathered are dropped in hand, neither acked nor ``nak``-ed: JetStream delivers them again only
after the consumer's ``ack_wait`` (30 s by default), however soon they could have run. After a
Postgres outage that is a stall of the whole batch.

So the middleware gives each pull subscriber's subscription a ``fetch`` that raises nats-py's
own timeout for both: the loop then runs what it gathered at once. Only the one subscription
object is wrapped (nats-py's and FastStream's classes are left alone), each time FastStream
creates it (``_create_subscription``, internal: FastStream has no hook after a subscriber
subscribes).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

#: marks a subscriber (or subscription) already wrapped
_WRAPPED = "_consumer_idem_fetch_timeouts"


def catch_fetch_timeouts(subscriber: Any) -> None:
    """Make every subscription ``subscriber`` (a NATS pull subscriber) creates raise only
    nats-py's ``TimeoutError`` from ``fetch``; other subscribers are left alone."""
    if getattr(subscriber, "pull_sub", None) is None or getattr(subscriber, _WRAPPED, False):
        return
    create: Callable[[], Awaitable[None]] = subscriber._create_subscription

    @functools.wraps(create)
    async def create_subscription() -> None:
        await create()
        subscription = getattr(subscriber, "subscription", None)
        if subscription is not None and not getattr(subscription, _WRAPPED, False):
            subscription.fetch = _nats_timeouts(subscription.fetch)
            setattr(subscription, _WRAPPED, True)

    subscriber._create_subscription = create_subscription
    setattr(subscriber, _WRAPPED, True)


def _nats_timeouts(fetch: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from nats.errors import TimeoutError as NatsTimeout  # type: ignore[import-not-found, unused-ignore]

    @functools.wraps(fetch)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fetch(*args, **kwargs)
        except NatsTimeout:
            raise
        except TimeoutError as exc:  # nats-py's other timeout: the same "nothing more"
            raise NatsTimeout from exc

    return wrapped
