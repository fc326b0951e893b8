"""``max_deliveries`` on brokers that count deliveries themselves (JetStream's
``num_delivered``, a Redis stream's pending-entries count).

Such a counter rises with every delivery, including those handed back while waiting for the
store or for another owner of the key: during a Postgres outage it can pass any limit without
the handler having run once. So only the key's own failed runs, as the store counted them, are
spent, never more than the broker's count.
"""

from __future__ import annotations

import dataclasses

from consumer_idem.consumer import Action, Verdict
from consumer_idem.transports import settle

#: the dead-letter reason of a key that spent its deliveries
MAX_DELIVERIES_EXCEEDED = "max_deliveries_exceeded"


def exhausted(delivered: int, verdict: Verdict, limit: int | None) -> Verdict | None:
    """The dead-letter verdict of a retry whose key has spent ``limit`` deliveries, or None
    (hand it back for a retry). ``delivered`` is the broker's count for this delivery."""
    outcome = verdict.outcome
    spent = delivered if outcome is None else min(delivered, outcome.attempts)
    if limit is None or spent < limit or settle.is_wait(verdict):
        return None
    failure = verdict.error or (outcome and outcome.error)
    last = f"{verdict.reason}: {failure!r}" if failure else verdict.reason
    return dataclasses.replace(
        verdict,
        action=Action.DEAD_LETTER,
        reason=MAX_DELIVERIES_EXCEEDED,
        error=f"delivered {spent} times, last failure: {last}",
    )
