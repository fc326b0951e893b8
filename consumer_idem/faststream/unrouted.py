"""Kafka deliveries FastStream could not hand to the handler, settled instead of dropped.

FastStream parses a delivery and picks the handler whose filter accepts it before any
middleware's handler call runs. When its parser raises (a header value that is not UTF-8, a
custom parser's error) or no filter accepts the delivery, FastStream logs the error and goes on
with the next delivery, whose commit would then pass the one that never ran: a lost record. So
the middleware settles these itself:

* a delivery no handler accepts is dead-lettered whole (reason ``no_handler``);
* a record the parser refuses, parsed on its own, is dead-lettered (reason ``unparseable``,
  with the parser's error); the other records of its batch run without it, through the
  middleware (other middlewares' handler wrappers are not applied to that run);
* a delivery whose every record parses on its own failed for another reason: it is handed
  back, as any failure before a verdict.

On RabbitMQ such a delivery stays unacked (a manual-ack subscriber never acks it), so it is not
lost; it is left to FastStream.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from consumer_idem.consumer import Action, Verdict
from consumer_idem.faststream import batch

if TYPE_CHECKING:
    from consumer_idem.faststream import Idempotency


async def settle_unrouted(idem: Idempotency, context: Any, raw: Any, exc: BaseException) -> bool:
    """Settle a Kafka delivery (a record, or a batch's records) that FastStream failed to hand
    to a handler with ``exc``; False when it is not one to settle here (handed back)."""
    from faststream.exceptions import SubscriberNotFound

    from consumer_idem.faststream import _Kafka
    from consumer_idem.transports.kafka import to_message

    subscriber = context.get("handler_")
    is_batch = isinstance(raw, tuple | list)
    records = list(raw) if is_batch else [raw]
    if (
        not isinstance(idem.transport, _Kafka)
        or subscriber is None
        or not records
        or not all(hasattr(record, "offset") for record in records)
    ):
        return False
    refused: dict[int, Verdict] = {}
    if isinstance(exc, SubscriberNotFound):
        for record in records:
            refused[id(record)] = _dead(idem, "no_handler", "no handler's filter accepts it")
    else:
        for record in records:
            why = await _parse_error(subscriber, (record,) if is_batch else record)
            if why is not None:
                refused[id(record)] = _dead(idem, "unparseable", why)
        if not refused:
            return False  # each parses alone: not the records' fault
    members = [to_message(record) for record in records]
    decided: dict[int, Verdict | None] = dict(refused)
    rest = tuple(r for r in records if id(r) not in refused)
    if rest:
        decided.update(await _run_rest(idem, context, subscriber, rest))
    consumer = getattr(records[0], "consumer", None) or getattr(subscriber, "consumer", None)
    await batch.settle_batch(
        idem, subscriber, consumer, members, [decided.get(id(r)) for r in records]
    )
    return True


def _dead(idem: Idempotency, reason: str, why: str) -> Verdict:
    return Verdict(Action.DEAD_LETTER, idem.scope, reason=reason, error=why[:1000])


async def _parse_error(subscriber: Any, raw: Any) -> str | None:
    """Why the subscriber's parser refuses ``raw``, or None when it parses."""
    for call in subscriber.calls:
        try:
            await call.is_suitable(raw, {})
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


async def _run_rest(
    idem: Idempotency, context: Any, subscriber: Any, rest: tuple[Any, ...]
) -> dict[int, Verdict | None]:
    """The verdicts of a batch's parseable records, run through the middleware as the batch
    FastStream would have delivered without the refused ones (unsettled: the caller settles
    every record of the delivery in offset order)."""
    from consumer_idem.faststream import _Middleware, _Settled

    for call in subscriber.calls:
        parsed = await call.is_suitable(rest, {})
        if parsed is None:
            continue
        middleware = _Middleware(rest, context=context, idem=idem)
        with contextlib.suppress(_Settled):  # raised by the middleware once it has verdicts
            await call.call(message=parsed, _extra_middlewares=[middleware.consume_scope])
        verdicts = middleware.verdicts or []
        return {id(r): verdicts[i] if i < len(verdicts) else None for i, r in enumerate(rest)}
    return {id(r): _dead(idem, "no_handler", "no handler's filter accepts it") for r in rest}
