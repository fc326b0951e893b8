"""The deliveries a RabbitMQ runner holds in hand (its channel's prefetch window), and their
workers: one task per delivery, or per batch in batch mode.

A `ChannelWindow` decides each delivery through the consumer (held in hand while it must
wait), settles it through the runner (the settle path's transport: ack, publish, hand back),
and keeps the tasks so that stopping can finish them. The runner
([`RabbitRunner`][consumer_idem.transports.rabbit.RabbitRunner]) connects, consumes, collects
batches
and stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractIncomingMessage

from consumer_idem.backoff import Backoff
from consumer_idem.consumer import Action, Verdict
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle
from consumer_idem.transports.delivery_budget import DeliveryBudget
from consumer_idem.transports.rabbit_message import (
    lost,
    redelivered_before,
    spent_deliveries,
    to_message,
)
from consumer_idem.transports.run_gate import process_gate
from consumer_idem.transports.settle import Settled

if TYPE_CHECKING:
    from consumer_idem.transports.rabbit import RabbitRunner

log = logging.getLogger("consumer_idem.transports.rabbit")

#: how long a delivery handed back after an unexpected failure waits first (by its count)
HANDBACK_BACKOFF = Backoff(0.5, 10.0)

Message = AbstractIncomingMessage


class ChannelWindow:
    """The runner's deliveries in hand, each with its worker task."""

    def __init__(self, runner: RabbitRunner, budget: DeliveryBudget | None) -> None:
        self.runner = runner
        self.consumer = runner.consumer
        #: counted in Postgres for a consumer with keys; the broker's count otherwise
        self.budget = budget
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self, within: float) -> None:
        """Wait for the workers (and those they start: a batch's lone members, the ack
        flusher) for ``within`` seconds; cancel those still running then (unacked: the broker
        redelivers them once the channel closes)."""
        deadline = time.monotonic() + within
        while self.tasks:
            _, late = await asyncio.wait(
                set(self.tasks), timeout=max(0.0, deadline - time.monotonic())
            )
            if late and time.monotonic() >= deadline:
                for task in late:
                    task.cancel()
                await asyncio.wait(late)
                break

    # --- one delivery --------------------------------------------------------------------------

    async def handle(self, message: Message, verdict: Verdict | None = None) -> None:
        """The worker of one delivery: decided (held in hand while its verdict is a wait),
        then settled; handed back when anything fails unexpectedly. The consumer is called
        from here and `_attempt` only, so the handler runs few frames below this
        worker (``tests/test_handler_depth.py``)."""
        runner = self.runner
        try:
            if verdict is None:
                if self.over_budget(spent_deliveries(to_message(message))):
                    verdict = Verdict(
                        Action.DEAD_LETTER, self.consumer.scope, reason="max_deliveries"
                    )
                else:
                    holding = settle.Holding(runner.stats, runner.stopping, runner.max_hold)
                    counted: list[int] = []
                    verdict = await self._attempt(message, counted)
                    while await holding.again(verdict):
                        verdict = await self._attempt(message, counted)
            await settle.settle(runner, message, verdict)
        except asyncio.CancelledError:
            raise  # stop() gave up on it: unacked, the broker delivers it again after we close
        except Exception as exc:
            runner.stats.failures += 1
            log.log(
                logging.WARNING if lost(exc) else logging.ERROR,
                "delivery %s failed (%r); handing it back",
                message.delivery_tag,
                exc,
                exc_info=None if lost(exc) else exc,
            )
            await self.hand_back(message)

    async def _attempt(self, message: Message, counted: list[int]) -> Verdict:
        """One try of a delivery. A fresh view per try: a handler that changed the parsed
        body in place must not hand its changes to the next try. With a delivery budget, a
        redelivered delivery (a suspect: maybe what killed the last consumer) runs alone and
        is counted once; a first delivery runs beside the others."""
        view = to_message(message)
        budget = self.budget
        if budget is None:
            return await self.consumer.process(view)
        if not redelivered_before(message):
            async with process_gate().shared():
                return await self.consumer.process(view)
        consumer = budget.consumer
        prepared = consumer.prepare(view)
        if isinstance(prepared, Verdict):
            return prepared  # no key: dead-lettered with its reason, as when fresh
        async with process_gate().alone():  # a crash is then the running one's
            refused = await budget.admit(prepared[0], counted)
            if refused is not None:
                return refused
            return await consumer.execute(view, *prepared)

    def over_budget(self, spent: int | None) -> bool:
        """Delivered ``max_deliveries`` times by the broker's count, for a processor with no
        budget in Postgres (the reconciler): dead-lettered without running again."""
        if self.budget is not None:
            return False
        limit = self.runner.max_deliveries
        return limit is not None and spent is not None and spent >= limit

    async def hand_back(self, message: Message) -> None:
        count = to_message(message).delivery_count or 0
        await settle.pause(HANDBACK_BACKOFF.delay(count + 1), self.runner.stopping)
        try:
            await self.runner.send(message, ack=False)
        except Exception as exc:  # channel gone: the broker redelivers it anyway
            log.warning("could not hand back delivery %s: %r", message.delivery_tag, exc)

    async def settle_alone(self, message: Message, verdict: Verdict) -> None:
        """A member a batch could not settle: a wait is decided again on its own, with the
        delivery in hand; a failure is retried later."""
        await self.handle(message, None if settle.is_wait(verdict) else verdict)

    # --- batch mode ----------------------------------------------------------------------------

    async def handle_batch(self, messages: list[Message]) -> None:
        """The worker of one batch; what it leaves unsettled after a failure is handed back."""
        unsettled = dict.fromkeys(messages)  # in order; a member leaves once it is settled
        try:
            await self._run_batch(unsettled)
        except asyncio.CancelledError:
            raise  # stop() gave up on it: unacked, the broker delivers it again after we close
        except Exception as exc:
            self.runner.stats.failures += 1
            log.log(
                logging.WARNING if lost(exc) else logging.ERROR,
                "a batch of %d deliveries failed (%r); handing back the %d unsettled",
                len(messages),
                exc,
                len(unsettled),
                exc_info=None if lost(exc) else exc,
            )
            for message in unsettled:
                self.spawn(self.hand_back(message))

    async def _admit(self, unsettled: dict[Message, None]) -> tuple[list[Message], list[Any]]:
        """The batch's first deliveries, with their views; a member over the broker's budget
        is dead-lettered, a redelivered one runs on its own."""

        fresh: list[Message] = []
        views: list[ConsumerMessage] = []  # for the first attempt (not decoded yet)
        for message in list(unsettled):
            view = to_message(message)
            if self.over_budget(spent_deliveries(view)):
                verdict = Verdict(Action.DEAD_LETTER, self.consumer.scope, reason="max_deliveries")
                await settle.settle(self.runner, message, verdict)
                del unsettled[message]
            elif redelivered_before(message):
                # delivered before and never settled: maybe what killed the last consumer
                del unsettled[message]
                self.spawn(self.handle(message))
            else:
                fresh.append(message)
                views.append(view)
        return fresh, views

    async def _run_batch(self, unsettled: dict[Message, None]) -> None:
        fresh, views = await self._admit(unsettled)
        started = time.monotonic()
        while fresh:
            # a fresh view per attempt: a handler that changed the parsed bodies in place
            # must not hand its changes to the next attempt
            if not views:
                views = [to_message(m) for m in fresh]
            run = functools.partial(self.consumer.process_batch, views)
            budget = self.budget
            verdicts = await (run if budget is None else budget.fresh(run))()
            views = []
            done = await self._settle_prefix(fresh, verdicts, unsettled)
            if done is None:
                return  # stopping before a publish was confirmed: unacked, redelivered
            fresh = await self._rest(fresh[done:], verdicts, done, unsettled, started)

    async def _settle_prefix(
        self, fresh: list[Message], verdicts: list[Verdict], unsettled: dict[Message, None]
    ) -> int | None:
        """The batch's verdicts carried out in order up to the first wait: how many were
        settled (None: one was left unsettled, stopping)."""
        done = 0
        for message, verdict in zip(fresh, verdicts, strict=False):
            if verdict.action is Action.RETRY:
                break
            outcome = await settle.settle(self.runner, message, verdict)
            if outcome is Settled.UNSETTLED:
                return None
            del unsettled[message]
            done += 1
        return done

    async def _rest(
        self,
        rest: list[Message],
        verdicts: list[Verdict],
        done: int,
        unsettled: dict[Message, None],
        started: float,
    ) -> list[Message]:
        """What follows a settled prefix: the members to run again as a batch (empty: none)."""
        if not rest:
            return []
        if done >= len(verdicts):
            # the batch settled a prefix and left the rest to be decided again (its handler
            # ended the transaction itself): the rest runs as a batch of its own, or, if
            # nothing was settled, each member on its own
            if done:
                return rest
            for message in rest:
                del unsettled[message]
                self.spawn(self.handle(message))
            return []
        head, verdict = rest[0], verdicts[done]
        if verdict.reason == "store_unavailable":
            return await self._store_down(rest, verdict, unsettled, started)
        # one member must wait for another owner, or failed: it goes its own way (held in
        # hand, or delivered again after its backoff); the others go on without it
        del unsettled[head]
        self.spawn(self.settle_alone(head, verdict))
        return rest[1:]

    async def _store_down(
        self,
        rest: list[Message],
        verdict: Verdict,
        unsettled: dict[Message, None],
        started: float,
    ) -> list[Message]:
        """The store is down for every member: the batch waits in hand, whole, for at most
        ``max_hold``; after that (or stopping) each member is handed back."""
        runner, scope = self.runner, self.consumer.scope
        held = time.monotonic() - started
        if not runner.stopping() and (runner.max_hold is None or held < runner.max_hold):
            runner.stats.retries += 1
            log.info(
                "scope=%s: a batch of %d waits %.2fs in hand (store unavailable)",
                scope,
                len(rest),
                verdict.retry_after,
                extra={"scope": scope},
            )
            await settle.pause(max(verdict.retry_after, 0.05), runner.stopping)
            return rest
        for message in rest:
            del unsettled[message]
            self.spawn(self.settle_alone(message, verdict))
        return []
