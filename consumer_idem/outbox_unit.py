"""The outbox of one idempotent unit ([`UnitOutbox`][consumer_idem.outbox_unit.UnitOutbox]): what a
handler publishes through it
commits with the unit, or not at all. Re-exported by `consumer_idem.outbox`, which finds a
running unit's outbox by its connection ([`outbox_for`][consumer_idem.outbox.outbox_for])."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from consumer_idem.errors import NoOutbox, OutboxMessagesLost
from consumer_idem.outbox_identity import new_run, outgoing_key
from consumer_idem.stores.postgres.outbox import IDEMPOTENCY_HEADER, OutgoingMessage

__all__ = ["UnitOutbox", "lost_messages"]


def _text_ok(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(f"{what} must be a non-empty string without NUL, not {value!r}")
    return value


def _as_bytes(value: str | bytes | bytearray | memoryview, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, not {type(value).__name__}")


class UnitOutbox:
    """The outbox of one idempotent unit (one incoming ``scope``/``key``): what a handler
    publishes through it commits with the unit, or not at all. Get it with
    [`outbox_for`][consumer_idem.outbox_for].

    ``run``: this execution of the unit (a new one each time the key runs as new work);
    ``route``: the route of the sender serving its scope in this process (None: none)."""

    def __init__(
        self, scope: str, key: str, run: str | None = None, route: str | None = None
    ) -> None:
        self.scope = scope
        self.key = key
        self._run = run
        self.route = route
        #: the messages published so far, in order
        self.messages: list[OutgoingMessage] = []
        #: the unit's transaction has ended: nothing published now would commit
        self.ended = False

    @property
    def run(self) -> str:
        """This execution's id, drawn when the unit first publishes (most units publish
        nothing, and need none)."""
        if not self._run:
            self._run = new_run()
        return self._run

    def publish(
        self,
        destination: str,
        body: Any,
        *,
        headers: Mapping[str, str | bytes] | None = None,
        key: str | bytes | None = None,
    ) -> OutgoingMessage:
        """Send ``body`` to ``destination`` (a Kafka topic, a RabbitMQ queue) once the unit
        commits. ``body``: bytes, text (UTF-8) or a JSON value (sent as compact JSON with a
        ``content-type: application/json`` header). ``key``: the Kafka record key (RabbitMQ
        has none). The ``idempotency-key`` header is set here
        ([`outgoing_key`][consumer_idem.outbox_unit.outgoing_key]); passing
        one of your own is an error. Nothing is sent now: returns the message as it will go.
        Raises [`NoOutbox`][consumer_idem.outbox_unit.NoOutbox] once the unit has ended (kept past
        its handler, nothing
        published now could commit)."""
        if self.ended:
            raise NoOutbox(
                f"the unit ({self.scope!r}, {self.key!r}) has ended: its transaction is over, "
                f"so a message published now would never be sent (publish to {destination!r} "
                "inside the handler, through the outbox of the unit that is running)"
            )
        _text_ok(destination, "destination")
        extra: dict[str, bytes] = {}
        if isinstance(body, bytes | bytearray | memoryview):
            data = bytes(body)
        elif isinstance(body, str):
            data = body.encode("utf-8")
        else:
            try:
                data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise TypeError(f"the body is neither bytes, text nor JSON: {exc}") from exc
            extra["content-type"] = b"application/json"
        given = {
            _text_ok(name, "header name"): _as_bytes(value, f"header {name!r}")
            for name, value in (headers or {}).items()
        }
        if any(name.lower() == IDEMPOTENCY_HEADER for name in given):
            raise ValueError(
                f"the {IDEMPOTENCY_HEADER!r} header is the outbox's own (derived from the unit "
                "and the message's position, the same on every copy): do not set it"
            )
        position = len(self.messages)
        idempotency_key = outgoing_key(self.scope, self.key, position, self.run)
        all_headers = {**extra, **given, IDEMPOTENCY_HEADER: idempotency_key.encode()}
        message = OutgoingMessage(
            destination=destination,
            body=data,
            headers=tuple(all_headers.items()),
            key=None if key is None else _as_bytes(key, "key"),
            scope=self.scope,
            unit_key=self.key,
            position=position,
            idempotency_key=idempotency_key,
            run=self.run,
            route=self.route,
        )
        self.messages.append(message)
        return message


def lost_messages(unit: UnitOutbox | None) -> OutboxMessagesLost | None:
    """The error for ``unit``'s published messages when the handler ended the unit's transaction
    itself: they were never written and will never be sent (None: it published nothing)."""
    pending = unit.messages if unit is not None else []
    if not pending:
        return None
    named = tuple(
        f"position {m.position} to {m.destination!r} (idempotency-key {m.idempotency_key})"
        for m in pending
    )
    return OutboxMessagesLost(
        "the handler ended the idempotency transaction itself (COMMIT or ROLLBACK on its "
        f"connection) with {len(named)} outbox message(s) pending, now lost: " + "; ".join(named),
        named,
    )
