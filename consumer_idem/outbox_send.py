"""Sending outgoing messages of the outbox: the sender protocol, groups sent in order, what a
failure holds back, and the counters and logs both senders (dispatch and relay) share."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from consumer_idem.backoff import Backoff
from consumer_idem.errors import (
    ConsumerIdemError,
)
from consumer_idem.stores.postgres.outbox import (
    OutgoingMessage,
)
from consumer_idem.stores.postgres.store import PostgresStore

log = logging.getLogger("consumer_idem.outbox")


#: how a message whose send failed (for a reason that may pass) is retried by the relay
RETRY_BACKOFF = Backoff(1.0, 300.0)


@runtime_checkable
class OutboxSender(Protocol):
    """What sends outgoing messages: ``KafkaOutboxSender``, ``RabbitOutboxSender``
    (``consumer_idem.transports``), the runners, FastStream's ``Idempotency``.

    A sender also states its ``route`` (a string attribute: the transport and the broker it
    sends to, e.g. ``kafka:<bootstrap servers>``), recorded with the messages it is to send;
    a relay sends only messages of its sender's route (see `consumer_idem.outbox_identity`).
    One without a ``route`` serves only relays that name their scopes."""

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        """Publish ``messages`` and wait for the broker's confirmations: for each, ``None``
        (confirmed) or the error. Messages of one
        [`OutgoingMessage.group`][consumer_idem.outbox.OutgoingMessage.group] go in order,
        and after one of them failed (not for good) the later ones are not sent
        ([`HeldBack`][consumer_idem.outbox_send.HeldBack])."""
        ...

    def permanent(self, exc: BaseException) -> bool:
        """Whether the broker will refuse the same message again (it is parked)."""
        ...


class HeldBack(ConsumerIdemError):
    """Not sent: an earlier message of its unit to the same destination and key failed, and
    sending this one first would change their order."""


def failure_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


@dataclass
class _Sorted:
    sent: list[OutgoingMessage]
    failed: list[tuple[OutgoingMessage, BaseException]]
    parked: list[tuple[OutgoingMessage, BaseException]]


async def _send(
    sender: OutboxSender, messages: Sequence[OutgoingMessage], within: float
) -> _Sorted:
    try:
        results = await asyncio.wait_for(sender.send_batch(messages), within)
    except Exception as exc:  # the sender itself failed (no connection, a timeout): all of them
        results = [exc] * len(messages)
    if len(results) != len(messages):
        raise RuntimeError(f"the sender answered {len(results)} results for {len(messages)}")
    out = _Sorted([], [], [])
    for message, result in zip(messages, results, strict=True):
        if result is None:
            out.sent.append(message)
        elif sender.permanent(result):
            out.parked.append((message, result))
        else:
            out.failed.append((message, result))
    return out


def _count(store: PostgresStore, name: str, messages: Sequence[OutgoingMessage]) -> None:
    """Count ``name`` once per message, by the scope of the unit that published it."""
    for scope, n in Counter(m.scope for m in messages).items():
        store.metrics.inc(name, scope, n)


def _log_parked(parked: Sequence[tuple[OutgoingMessage, BaseException]]) -> None:
    for message, exc in parked:
        log.error(
            "scope=%s key=%s: outgoing message %d to %s refused for good (%s): parked, with "
            "its reason, for an operator",
            message.scope,
            message.unit_key,
            message.position,
            message.destination,
            failure_text(exc),
            extra={"scope": message.scope, "key": message.unit_key},
        )


def send_all(
    sender: Callable[[OutgoingMessage], Awaitable[Any]],
    messages: Sequence[OutgoingMessage],
    permanent: Callable[[BaseException], bool],
    concurrency: int = 256,
) -> Awaitable[list[BaseException | None]]:
    """A ``send_batch`` for a client that confirms one publish at a time (``send(message)``
    returns once the broker confirmed it): groups run side by side (at most ``concurrency``
    publishes at once), the messages of a group one after the other; after a failure that is
    not for good, the rest of its group is [`HeldBack`][consumer_idem.outbox_send.HeldBack]."""

    async def run() -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        groups: dict[Any, list[int]] = {}
        for i, message in enumerate(messages):
            groups.setdefault(message.group, []).append(i)
        slots = asyncio.Semaphore(concurrency)

        async def one_group(indices: list[int]) -> None:
            failed: BaseException | None = None
            for i in indices:
                if failed is not None:
                    results[i] = HeldBack(f"held back after {failure_text(failed)}")
                    continue
                try:
                    async with slots:
                        await sender(messages[i])
                except Exception as exc:
                    results[i] = exc
                    if not permanent(exc):
                        failed = exc

        await asyncio.gather(*(one_group(indices) for indices in groups.values()))
        return results

    return run()
