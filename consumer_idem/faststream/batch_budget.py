"""The delivery budget (``max_deliveries``) of a batch subscriber's members, on a broker that
counts each message's deliveries (NATS JetStream: ``num_delivered``).

A batch whose handler kills the process (SIGKILL, the OOM killer, a segfault) is rolled back
and delivered again whole, so counting the batch would charge every member for one poison,
and counting nothing would crash-loop forever. So a member JetStream delivered before (it may
be what killed the last process) is taken out of its batch and runs alone in the process, as a
batch of one, under the budget of a single message (`consumer_idem.faststream.budget`): one
attempt of its key counted in Postgres right before its handler, dead-lettered with reason
``max_deliveries`` once ``max_deliveries`` counted runs are spent. The members delivered for the
first time then run together, as one batch, never beside one running alone. A member killing
the process thus runs at most ``max_deliveries + 1`` times; its batch-mates run once each,
alone after the crash (a member that committed before it is replayed, not run again).

Kafka has no per-record delivery counter: its batches run whole, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from consumer_idem.consumer import Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports.run_gate import process_gate

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency
    from consumer_idem.transports.delivery_budget import DeliveryBudget


def split(
    idem: Idempotency, members: Sequence[ConsumerMessage]
) -> tuple[list[ConsumerMessage], list[ConsumerMessage]]:
    """``(alone, together)``: the members delivered before (each to run alone, counted) and
    the others (one batch), each in delivery order. Without a budget: all together."""
    from consumer_idem.faststream.nats_side import _Nats

    if idem.budget is None or not isinstance(idem.transport, _Nats):
        return [], list(members)
    alone = [m for m in members if (m.delivery_count or 1) > 1]
    return alone, [m for m in members if (m.delivery_count or 1) <= 1]


async def process(
    idem: Idempotency,
    alone: Sequence[ConsumerMessage],
    together: Sequence[ConsumerMessage],
    ahead: Any = None,
) -> list[Verdict]:
    """Verdicts for ``alone`` then ``together``, in that order; the list stops early at a
    store outage or at the batch's first wait (the rest is not decided: handed back)."""
    consumer = idem.batch_consumer
    if idem.budget is None:
        return await consumer.process_batch(together, alongside=ahead)
    budget = idem.budget.budget
    verdicts: list[Verdict] = []
    for incoming in alone:
        verdicts.append(await _alone(idem, budget, incoming))
        if verdicts[-1].reason == "store_unavailable":
            return verdicts  # the store is down: the others would only wait too
    if together:
        run = functools.partial(consumer.process_batch, together, alongside=ahead)
        verdicts += await budget.fresh(run)()
    return verdicts


async def _alone(idem: Idempotency, budget: DeliveryBudget, incoming: ConsumerMessage) -> Verdict:
    """One redelivered member as a batch of one, alone in the process, counted ahead."""
    consumer = idem.batch_consumer
    prepared = consumer.prepare(incoming)
    if isinstance(prepared, Verdict):
        return prepared  # no key: dead-lettered with its reason, as in a batch

    async def run() -> Verdict:
        return (await consumer.process_batch([incoming]))[0]

    async with process_gate().alone():  # a crash now is this member's
        # a run that only waited (lock wait, outage, another owner) gives its attempt back
        return await budget.run_counted(prepared[0], [], run)
