"""One delivery through [`Idempotency`][consumer_idem.faststream.Idempotency]: claim, run,
settle."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from faststream import BaseMiddleware, StreamMessage
from faststream.message import AckStatus

from consumer_idem.consumer import (
    Action,
    Verdict,
)
from consumer_idem.errors import (
    IdempotencyConfigError,
)
from consumer_idem.faststream import _compat, batch, batch_budget, redis_hold
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.faststream.context import _CURRENT, _Call, _Settled
from consumer_idem.faststream.results import _NOTHING, _published_form
from consumer_idem.faststream.settler import _Settler
from consumer_idem.faststream.typed import call_hooks, typed
from consumer_idem.message import ConsumerMessage
from consumer_idem.transports import settle
from consumer_idem.types import OutcomeKind, ResultKind

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency

log = logging.getLogger("consumer_idem.faststream")


class _Middleware(BaseMiddleware):
    """One delivery through `Idempotency`."""

    def __init__(self, msg: Any, /, *, context: Any, idem: Idempotency) -> None:
        super().__init__(msg, context=context)
        self.idem = idem
        self.message: StreamMessage[Any] | None = None
        self.subscriber: Any = None
        self.incoming: ConsumerMessage | None = None
        self.verdict: Verdict | None = None
        #: a batch subscriber's delivery: its records and their verdicts (in order, up to the
        #: first that must wait)
        self.members: list[ConsumerMessage] | None = None
        self.verdicts: list[Verdict] | None = None
        #: a Redis entry kept claimed while in hand (`consumer_idem.faststream.redis_hold`)
        self.keeper: redis_hold.Keeper | None = None

    async def consume_scope(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        idem = self.idem
        self.subscriber = _compat.current_subscriber(self.context)
        idem.check_subscriber(self.subscriber)
        if msg.committed is not None:
            raise IdempotencyConfigError(
                "the delivery was acknowledged before the handler ran (AckPolicy.ACK_FIRST, "
                "FastStream's default on Kafka, auto-commits): subscribe with "
                "ack_policy=AckPolicy.MANUAL"
            )
        self.message = msg
        self.keeper = redis_hold.keep(idem, msg, self.subscriber)  # until after_processed
        await idem.outbox_relay.first_delivery()
        if batch.is_batch(msg):  # a Kafka, NATS or Redis batch subscriber
            # NATS: a member delivered before runs alone, under the budget (batch_budget)
            members = await batch.members(idem, self.subscriber, msg)
            alone, together = batch_budget.split(idem, members)
            self.members = alone + together
            ahead = None
            if together and batch.innermost(self.subscriber, call_next):
                ahead = batch.DecodedAhead(msg, together, self.context)
            token = _CURRENT.set(_Call(call_next, msg, self.context, "", ahead))
            try:
                verdicts = await batch_budget.process(idem, alone, together, ahead)
            finally:
                _CURRENT.reset(token)
            result_type = idem.result_types.of(self.subscriber, batch=True)
            self.verdicts = [typed(v, result_type) for v in verdicts]
            call_hooks(idem, self.verdicts)
            raise _Settled(None)  # a batch subscriber publishes nothing through FastStream
        self.incoming = idem.transport.incoming(msg)
        if idem.transport.holds_waits:
            process: Callable[[], Awaitable[Verdict]]
            process = functools.partial(self._run, call_next, msg)
            if idem.budget is not None:
                process = idem.budget.processing(
                    msg,
                    self.subscriber,
                    functools.partial(idem.transport.incoming, msg),
                    functools.partial(self._execute, call_next, msg),
                    process,
                )
            stopping = _Settler(idem, self.subscriber).stopping
            verdict = await settle.process_holding(
                process, stats=idem.stats, stopping=stopping, max_hold=idem.max_hold
            )
        elif idem.budget is not None:  # NATS, Redis: a wait is not held in hand
            verdict = await idem.budget.processing(
                msg,
                self.subscriber,
                functools.partial(idem.transport.incoming, msg),
                functools.partial(self._execute, call_next, msg),
                functools.partial(self._run, call_next, msg),
            )()
        else:
            verdict = await self._run(call_next, msg)
        verdict = typed(verdict, idem.result_types.of(self.subscriber))
        self.verdict = verdict
        call_hooks(idem, [verdict])
        outcome = verdict.outcome
        if (
            verdict.action is Action.ACK
            and not verdict.reconcile
            and outcome is not None
            and outcome.kind in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED)
            and outcome.result_kind is ResultKind.SUCCESS
        ):
            published = _published_form(verdict.result)
            if published is not _NOTHING:
                return published
        raise _Settled(verdict)

    async def _run(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Verdict:
        consumer = self.idem.consumer
        # a fresh view per attempt: a handler that changed the parsed body in place must not
        # hand its changes to the next attempt
        incoming = self.idem.transport.incoming(msg)
        prepared = consumer.prepare(incoming)
        if isinstance(prepared, Verdict):
            return prepared
        return await self._execute(call_next, msg, incoming, *prepared)

    async def _execute(
        self,
        call_next: Callable[[StreamMessage[Any]], Awaitable[Any]],
        msg: StreamMessage[Any],
        incoming: ConsumerMessage,
        key: str,
        fingerprint: str,
    ) -> Verdict:
        """The claim engine on a prepared delivery, FastStream's handler call at hand."""
        token = _CURRENT.set(_Call(call_next, msg, self.context, key))
        try:
            return await self.idem.consumer.execute(incoming, key, fingerprint)
        finally:
            _CURRENT.reset(token)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        try:
            return await self._settle(exc_val)
        finally:
            if self.keeper is not None:
                self.keeper.stop()

    async def _settle(self, exc_val: BaseException | None) -> bool | None:
        message, verdict = self.message, self.verdict
        if isinstance(exc_val, IdempotencyConfigError | asyncio.CancelledError):
            return False  # never ours to settle (or shutting down: it is delivered again)
        if message is None:
            if self.context.get("message") is not None:
                return False  # routed, but a middleware outside this one did not call it
            # FastStream failed to parse or route it (its error may have been swallowed by
            # an exception middleware inside this one)
            return await self._unrouted(exc_val)
        decided = verdict is not None if self.members is None else self.verdicts is not None
        if not decided or (exc_val is not None and not isinstance(exc_val, _Settled)):
            # Failed before a verdict, or the result could not be published after the commit:
            # deliver it again (a batch: each partition from its first record); the redelivery
            # replays the stored result and publishes it.
            self.idem.stats.retries += 1
            log.warning("delivery not settled, will be delivered again: %r", exc_val)
            settler = _Settler(self.idem, self.subscriber)
            await settle.pause(self.idem.consumer.backoff_base, settler.stopping)
            await settler.give_back(message)
            return False
        if self.members is not None:
            assert self.verdicts is not None
            consumer = getattr(message, "consumer", None)
            done = await batch.settle_batch(
                self.idem, self.subscriber, consumer, self.members, self.verdicts
            )
            message.committed = AckStatus.ACKED if done else AckStatus.NACKED
        else:
            assert verdict is not None
            await settle.settle(self._settler(message), message, verdict)
        return exc_val is not None  # our own _Settled: swallowed

    async def _unrouted(self, exc: BaseException | None) -> bool:
        """A delivery FastStream could not parse or route (``consumer_idem.faststream.unrouted``):
        dead-letter what cannot run, run the rest; anything else is handed back."""
        from consumer_idem.faststream import unrouted

        self.subscriber = _compat.current_subscriber(self.context)
        try:
            if await unrouted.settle_unrouted(self.idem, self.context, self.msg):
                return exc is not None  # FastStream's error: handled
        except Exception as failure:
            log.warning("could not settle a delivery FastStream refused: %r", failure)
        records = unrouted.kafka_records(self.idem, self.msg)
        if records:
            self.idem.stats.retries += 1
            log.warning("delivery not handed to the handler, will be delivered again: %r", exc)
            stopping = _Settler(self.idem, self.subscriber).stopping
            await settle.pause(self.idem.consumer.backoff_base, stopping)
            await unrouted.seek_back(self.idem, self.subscriber, records)
        return False

    def _settler(self, message: StreamMessage[Any]) -> _Settler:
        source = self.idem.transport.source(message, self.subscriber)
        return _Settler(self.idem, self.subscriber, self.incoming, source)
