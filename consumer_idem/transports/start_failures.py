"""A runner whose start fails closes what it opened, and says why in one line.

A start can fail half-way: the producer connected and the consumer's group join refused, the
AMQP connection open and a queue declaration refused. Whatever was opened is closed before
the error goes up (each close on its own: one failing does not keep the others open), so a
process that gives up or retries leaks no connection, socket or background task.

RabbitMQ refuses to declare a queue that exists with other arguments (a classic queue where
the runner declares a quorum one, another ``x-max-length``): ``PRECONDITION_FAILED`` closes the
channel, and aio-pika's robust connection then logs a page of tracebacks while trying to
restore it. That is a set-up mistake with a known remedy, so it becomes one
[`ConfigurationError`][consumer_idem.errors.ConfigurationError] naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from consumer_idem.errors import ConfigurationError

log = logging.getLogger("consumer_idem.transports")


async def close_all(*closers: Callable[[], Awaitable[Any]]) -> None:
    """Run every closer, in order, whatever the others do (their failures are logged: the
    start's own error is the one to report)."""
    for close in closers:
        try:
            await close()
        except Exception as exc:
            log.debug("closing after a failed start: %r", exc)


def queue_mismatch(exc: BaseException, arguments: Mapping[str, Any]) -> ConfigurationError | None:
    """The one-line error for a declaration RabbitMQ refused because the queue exists with
    other arguments (None for any other failure)."""
    try:
        from aiormq.exceptions import ChannelPreconditionFailed
    except ImportError:  # pragma: no cover - aio-pika depends on aiormq
        return None
    if not isinstance(exc, ChannelPreconditionFailed):
        return None
    reason = _server_reason(exc)
    declared = ", ".join(f"{k}={v!r}" for k, v in arguments.items()) or "no arguments"
    return ConfigurationError(
        f"RabbitMQ refused to declare a queue: {reason}. The queue exists with other "
        f"arguments than this runner declares (durable, {declared}): pass declare=False to "
        "use the existing queues as they are, or queue_arguments= matching them"
    )


def _server_reason(exc: BaseException) -> str:
    """RabbitMQ's own words (``PRECONDITION_FAILED - inequivalent arg ...``), on one line."""
    for arg in exc.args:
        text = str(arg)
        if "PRECONDITION_FAILED" in text:
            return " ".join(text.split())
    return " ".join(str(exc).split()) or type(exc).__name__
