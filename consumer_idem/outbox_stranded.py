"""Messages pending for a route no relay of their scope serves (``outbox_stranded``).

A row records its route as the sender stated it when its unit ran: the transport and the
cluster as configured (``kafka:<bootstrap servers>``, ``amqp:<host:port>[/<vhost>]``). A relay
sends only its own route's rows, so a message never goes to a cluster it was not published
for. The other side of that rule: after a redeploy that spells the cluster otherwise (a broker
added to the bootstrap list, a DNS name for an address) or that moves the scope to another
broker, the rows left pending under the old route are no relay's. They are never sent blindly;
the relay of their scope reports them, and an operator moves them to the route they are now
for (``store.outbox.reroute(old, new)``), where they go out with the keys they had.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from consumer_idem.outbox import OutboxRelay

__all__ = ["report_stranded"]

log = logging.getLogger("consumer_idem.outbox")


async def report_stranded(relay: OutboxRelay) -> None:
    """Set the ``outbox_stranded`` gauge of ``relay``'s scopes (a relay for every scope cannot
    tell which are its own: it reports nothing) and warn once for each (scope, route) that
    has messages no relay of theirs may send, for longer than ``relay.stranded_after``."""
    if relay.scopes is None:
        return
    routes = [] if relay.route is None else [relay.route]
    found = await relay.store.outbox.stranded(relay.scopes, routes, relay.stranded_after)
    metrics = relay.store.metrics
    counts = dict.fromkeys((metrics.label(s) for s in relay.scopes), 0.0)
    for scope, route, n in found:
        counts[metrics.label(scope)] += n
        if (scope, route) not in relay.stranded_warned:
            log.warning(
                "scope=%s: %d outbox messages wait for route %r, not this relay's (%r): no "
                "relay of this scope sends them (outbox_stranded). If they are for this "
                "relay's broker (the same cluster configured otherwise, or the scope moved "
                "here), move them: await store.outbox.reroute(%r, %r, scope=%r)",
                scope,
                n,
                route,
                relay.route,
                route,
                relay.route,
                scope,
                extra={"scope": scope},
            )
    relay.stranded_warned = {(scope, route) for scope, route, _ in found}
    for label, total in counts.items():
        metrics.gauge("outbox_stranded", label, total)
