"""The transactional outbox: outgoing messages are part of the idempotent effect.

A handler that publishes straight to a broker publishes even when its transaction then rolls
back, and again when a redelivery runs after a crash before the ack. Through the outbox, a
handler's messages are rows inserted in the unit's own transaction, with its effect and its
idempotency record: nothing leaves before the COMMIT, a rollback leaves nothing, and a replayed
duplicate does not run the handler, so it publishes nothing::

    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO ledger ...")
        outbox_for(conn).publish("payments.booked", {"payment_id": ...}, key=b"cust-7")

How a handler reaches its unit's outbox, per entry point (the unit is found by its connection):

* ``@idempotent_consumer`` / [`run_transactional`][consumer_idem.execution.run_transactional]:
  ``outbox_for(conn)``; in batch mode ``outbox_for(conn, message)`` (each message is a unit);
* HTTP (transactional routes): ``consumer_idem.http.outbox_of(request)`` (also a FastAPI
  dependency: ``outbox: UnitOutbox = Depends(outbox_of)``);
* FastStream: the ``IdempotentOutbox`` annotation (``consumer_idem.faststream``);
* a SQLAlchemy session bound to the unit: ``outbox_for(connection_of(session))``.

After the COMMIT, the process that ran the unit sends its messages at once (an
[`OutboxDispatcher`][consumer_idem.outbox.OutboxDispatcher] attached to the store, e.g. by a runner)
and marks them sent. A relay
([`OutboxRelay`][consumer_idem.outbox.OutboxRelay], ``FOR UPDATE SKIP LOCKED``: run it in as many
processes as you like) sends
what a crash, an outage or a full dispatch queue left behind, once the committing process has
had ``store.outbox.relay_after`` to do it. [`OutboxService`][consumer_idem.outbox.OutboxService]
runs both for a process.

What it promises: every message of a committed unit is sent at least once (a crash between the
broker's confirmation and the mark sends it again), and never one of a unit that did not commit.
Each carries an ``idempotency-key`` header derived from the unit's scope, key, run and the
message's position in the unit ([`outgoing_key`][consumer_idem.outbox.outgoing_key]), the same on
every copy: a consumer using this
library (``header("idempotency-key")``, the default key strategy) drops the copies for free.
Messages of one unit to one destination with one key are sent in the order they were
published. A message the broker refuses for good is parked with its reason
(``consumer-idem stats``, `parked`), never
dropped; it does not hold back the later ones.

This module finds a unit's outbox by its connection; sending is in `.outbox_send`, the
dispatch right after the commit in `.outbox_dispatch`, the relay and the service in
`.outbox_relay` (all re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from consumer_idem.errors import NoOutbox
from consumer_idem.outbox_dispatch import (
    OutboxDispatcher,
    attach_dispatcher,
    backpressure,
    committed,
    detach_dispatcher,
    dispatcher_for,
)
from consumer_idem.outbox_identity import outgoing_key, route_of
from consumer_idem.outbox_relay import OutboxRelay, OutboxService, RelayReport
from consumer_idem.outbox_send import (
    RETRY_BACKOFF,
    HeldBack,
    OutboxSender,
    failure_text,
    send_all,
)
from consumer_idem.outbox_unit import UnitOutbox
from consumer_idem.stores.postgres.outbox import (
    IDEMPOTENCY_HEADER,
    OutboxScopeStats,
    OutboxStats,
    OutgoingMessage,
    ParkedMessage,
)
from consumer_idem.stores.postgres.store import PostgresStore

__all__ = [
    "IDEMPOTENCY_HEADER",
    "HeldBack",
    "OutboxDispatcher",
    "OutboxRelay",
    "OutboxScopeStats",
    "OutboxSender",
    "OutboxService",
    "OutboxStats",
    "OutgoingMessage",
    "ParkedMessage",
    "RelayReport",
    "UnitOutbox",
    "attach_dispatcher",
    "outbox_for",
    "outgoing_key",
]

# re-exported for the modules that import them from here
__all__ += [
    "RETRY_BACKOFF",
    "backpressure",
    "committed",
    "detach_dispatcher",
    "dispatcher_for",
    "failure_text",
    "send_all",
]


# --- which unit runs on a connection -------------------------------------------------------------


@dataclass(eq=False)
class _Units:
    """The unit (or, in batch mode, the units by message) running on one connection. A batch's
    units are made when a handler first asks for one: most members publish nothing, and a
    batch of hundreds should not pay for hundreds of empty outboxes."""

    scope: str
    #: the route of the sender serving ``scope`` here when the units began
    route: str | None = None
    single: UnitOutbox | None = None
    #: batch mode: the members, and each one's key
    messages: tuple[Any, ...] = ()
    keys: Sequence[str] = ()
    #: batch mode: id(message) -> its position, built when a handler first asks for an outbox
    position: dict[int, int] | None = None
    #: batch mode: position -> the member's outbox, once asked for
    made: dict[int, UnitOutbox] = field(default_factory=dict)

    def all(self) -> list[UnitOutbox]:
        """Every unit with an outbox, in the batch's order."""
        if self.single is not None:
            return [self.single]
        return [self.made[i] for i in sorted(self.made)]

    def of(self, message: Any) -> UnitOutbox:
        if self.position is None:
            self.position = {id(m): i for i, m in enumerate(self.messages)}
        i = self.position.get(id(message))
        if i is None:
            raise NoOutbox("this message is not one of the batch this handler runs")
        unit = self.made.get(i)
        if unit is None:
            unit = self.made[i] = UnitOutbox(self.scope, self.keys[i], route=self.route)
        return unit


#: connection -> its running unit(s); an entry lives exactly as long as the unit's transaction
_running: dict[Any, _Units] = {}


def outbox_for(conn: Any, message: Any = None) -> UnitOutbox:
    """The outbox of the idempotent unit running on ``conn`` (the connection a transactional
    handler was given). In batch mode pass the ``message`` the outgoing one belongs to: each
    message of a batch is its own unit. Raises [`NoOutbox`][consumer_idem.outbox.NoOutbox] when no
    unit runs on ``conn``
    (it is not the unit's connection, the unit has ended, or it is two-phase)."""
    units = _running.get(conn)
    if units is None:
        raise NoOutbox(
            "no idempotent unit runs on this connection: use the connection your transactional "
            "handler was given, while it runs"
        )
    if units.single is not None:
        return units.single
    if message is None:
        raise NoOutbox(
            "batch mode: each message is its own unit; say which one the outgoing message "
            "belongs to: outbox_for(conn, message)"
        )
    return units.of(message)


def _route_here(store: PostgresStore | None, scope: str) -> str | None:
    dispatcher = None if store is None else dispatcher_for(store, scope)
    return None if dispatcher is None else route_of(dispatcher.sender)


def open_unit(conn: Any, scope: str, key: str, store: PostgresStore | None = None) -> UnitOutbox:
    """The claim engine: the unit (``scope``, ``key``) owns ``conn``'s transaction now (a new
    run of it; its messages are for the route of ``store``'s sender for ``scope``)."""
    route = _route_here(store, scope)
    unit = UnitOutbox(scope, key, route=route)
    _running[conn] = _Units(scope, route, single=unit)
    return unit


def open_batch(
    conn: Any,
    scope: str,
    messages: Sequence[Any],
    keys: Sequence[str],
    store: PostgresStore | None = None,
) -> _Units:
    """Batch mode: each of ``messages`` (with its key, ``keys[i]``) is a unit in ``conn``'s
    transaction; what they published is ``pending(units)`` of the answer."""
    units = _Units(scope, _route_here(store, scope), messages=tuple(messages), keys=keys)
    _running[conn] = units
    return units


def close_units(conn: Any) -> None:
    """The transaction on ``conn`` ended (committed or not): its units' outboxes take no more
    messages."""
    units = _running.pop(conn, None)
    if units is not None:
        for unit in units.all():
            unit.ended = True


def pending(units: _Units) -> list[OutgoingMessage]:
    """What the batch's members published: member by member, in the batch's order."""
    return [m for unit in units.all() for m in unit.messages]
