"""The broker's own delivery limit of a consumed quorum queue (``x-delivery-limit``).

A quorum queue drops (or dead-letters through its own ``x-dead-letter-exchange``) a message
returned more often than its delivery limit, whatever the runner would have decided. The
broker counts every return, also those another message caused (a consumer killed by one
delivery returns every one it held), while the runner's budget counts only the attempts that
ran the key's handler (``consumer_idem.transports.delivery_budget``). So the broker's limit
must never decide first:

* RabbitMQ 4 and later give every quorum queue a limit of 20 unless one is declared: the
  runner declares ``x-delivery-limit: -1`` (no limit) for the queues it declares, unless the
  arguments name a limit themselves. RabbitMQ 3 has no default limit, and there ``-1`` would
  drop a message at its first return: nothing is declared.
* A limit that is set (in the arguments given, or on a queue that exists) must allow at least
  ``max_deliveries`` deliveries, and ``max_deliveries=None`` (no budget) allows no limit at
  all. Otherwise the runner refuses to start with a
  [`ConfigurationError`][consumer_idem.ConfigurationError] saying which
  limit and how to fix it.

Only what AMQP shows can be checked: a limit set by a policy is not visible to a client.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import aiormq

from consumer_idem.errors import ConfigurationError

log = logging.getLogger("consumer_idem.transports.rabbit")

DELIVERY_LIMIT = "x-delivery-limit"
#: RabbitMQ 4's limit for a quorum queue declared without one
DEFAULT_LIMIT_V4 = 20
_CURRENT = re.compile(
    r"inequivalent arg 'x-delivery-limit'.*current is (?:the value )?(none|'(-?\d+)')"
)


def server_major(connection: Any) -> int | None:
    """The broker's major version, from the properties it announced (None: not announced)."""
    try:
        version = connection.transport.connection.server_properties.get("version")
        text = version.decode() if isinstance(version, bytes) else str(version)
        return int(text.split(".", 1)[0])
    except Exception:
        return None


def is_quorum(arguments: dict[str, Any]) -> bool:
    return arguments.get("x-queue-type") == "quorum"


def declared_arguments(arguments: dict[str, Any], major: int | None) -> dict[str, Any]:
    """The arguments to declare a consumed queue with: on RabbitMQ 4 and later (or an unknown
    version) a quorum queue without a limit of its own gets ``x-delivery-limit: -1``."""
    if not is_quorum(arguments) or DELIVERY_LIMIT in arguments or (major is not None and major < 4):
        return arguments
    return {**arguments, DELIVERY_LIMIT: -1}


def check_limit(limit: int | None, max_deliveries: int | None, queue: str, source: str) -> None:
    """Refuse a broker limit (None or negative: none) that could take a message before the
    runner's budget of ``max_deliveries`` decides."""
    if limit is None or limit < 0:
        return
    if max_deliveries is not None and limit >= max_deliveries:
        return
    budget = "no limit (max_deliveries=None)" if max_deliveries is None else max_deliveries
    raise ConfigurationError(
        f"queue {queue!r}: {source} x-delivery-limit is {limit}, but the runner's delivery "
        f"budget is {budget}: the broker would drop (or dead-letter elsewhere) a message that "
        "the runner still means to deliver. Set x-delivery-limit to -1 (RabbitMQ 4), remove "
        f"it (RabbitMQ 3), or to at least max_deliveries; or lower max_deliveries to {limit}."
    )


def check_arguments(arguments: dict[str, Any], max_deliveries: int | None, queue: str) -> None:
    """Refuse, when the runner is made, declared arguments whose limit is too low."""
    limit = arguments.get(DELIVERY_LIMIT)
    check_limit(None if limit is None else int(limit), max_deliveries, queue, "the declared")


def existing_limit(error: BaseException, major: int | None) -> int | None:
    """The limit of an existing queue, read from a declaration the broker refused for its
    ``x-delivery-limit`` (None: the refusal was about another argument, or there is no limit).
    A queue without one has RabbitMQ 4's default limit."""
    match = _CURRENT.search(str(error))
    if match is None:
        return None
    if match[2] is not None:
        return int(match[2])
    return DEFAULT_LIMIT_V4 if major is None or major >= 4 else None


async def declare_consumed(
    connection: Any,
    channel: Any,
    name: str,
    arguments: dict[str, Any],
    max_deliveries: int | None,
) -> Any:
    """Declare the consumed queue ``name`` on ``channel`` (robust: it is declared again after a
    reconnect), with its delivery limit checked. A queue that exists with another acceptable
    limit is taken as it is. Raises [`ConfigurationError`][consumer_idem.ConfigurationError] for a
    limit that is too low."""
    wanted = declared_arguments(arguments, major := server_major(connection))
    # tried on a channel of its own: a refused declaration closes the channel it was made on
    probe = await connection.channel()
    try:
        await probe.declare_queue(name, durable=True, arguments=wanted)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        if _CURRENT.search(str(exc)) is None:
            raise  # another argument differs: as it always did, the declaration fails
        limit = existing_limit(exc, major)
        check_limit(limit, max_deliveries, name, "the existing queue's")
        if limit is not None and limit >= 0:
            log.warning(
                "queue %r keeps its x-delivery-limit of %d: the broker counts every return, "
                "also those other messages cause, so it may drop a message before the budget of "
                "%s attempts is spent; prefer -1 (RabbitMQ 4) or no limit (RabbitMQ 3)",
                name,
                limit,
                max_deliveries,
            )
        return await channel.declare_queue(name, passive=True)
    finally:
        if not probe.is_closed:
            await probe.close()
    return await channel.declare_queue(name, durable=True, arguments=wanted)
