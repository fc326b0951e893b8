"""Kafka deliveries FastStream could not hand to the handler, settled instead of dropped.

FastStream parses a delivery and picks the handler whose filter accepts it before any
middleware's handler call runs. When its parser raises (a header value that is not UTF-8, a
custom parser's error) or no filter accepts the delivery, FastStream logs the error and goes on
with the next delivery, whose commit would then pass the one that never ran: a lost record. So
the middleware settles these itself:

* a delivery no handler accepts is dead-lettered whole (reason ``no_handler``);
* a record the parser refuses for bad data (a ``ValueError``, ``TypeError`` or
  ``LookupError``: a ``UnicodeDecodeError`` is one), parsed on its own, is dead-lettered
  (reason ``unparseable``, with the parser's error); the other records of its batch run without
  it, through the middleware (other middlewares' handler wrappers are not applied to that run);
* a delivery that routes when tried again, or whose parser or filter fails with any other
  error (a schema registry out of reach: an outage, not bad data), is handed back, as any
  failure before a verdict.

The delivery is routed again whatever FastStream's error was: an exception middleware inside
this one may have swallowed it.

On RabbitMQ such a delivery stays unacked (a manual-ack subscriber never acks it), so it is not
lost; it is left to FastStream.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from consumer_idem.consumer import Action, Verdict
from consumer_idem.faststream import _compat, batch

if TYPE_CHECKING:
    from consumer_idem.faststream import Idempotency

log = logging.getLogger("consumer_idem.faststream")


#: a parser's or filter's errors that say the record is bad (the same on every attempt); any
#: other error (a schema registry unreachable, a timeout) is an outage: the delivery waits
DATA_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError)


class _Outage(Exception):
    """Parsing or routing failed with an error that is not the records' (see DATA_ERRORS)."""


async def settle_unrouted(idem: Idempotency, context: Any, raw: Any) -> bool:
    """Settle a Kafka delivery (a record, or a batch's records) that never reached the
    middleware's handler call; False when it is not one to settle here (it is handed back).
    Whatever FastStream's error was (an exception middleware inside this one may have
    swallowed it), the delivery is routed again to find out."""
    from consumer_idem.faststream import redis_unrouted
    from consumer_idem.faststream.kafka_side import _Kafka

    subscriber = _compat.current_subscriber(context)
    if subscriber is not None and redis_unrouted.is_stream_entry(raw):
        return await redis_unrouted.settle_unrouted(idem, subscriber, raw)
    records = kafka_records(idem, raw)
    if subscriber is None or not records:
        return False
    is_batch = isinstance(raw, tuple | list)
    try:
        refused = await _refused(idem, subscriber, raw, records, is_batch)
        if not refused:
            return False  # it routes now: the failure was not the records'
        decided: dict[int, Verdict | None] = dict(refused)
        rest = tuple(r for r in records if id(r) not in refused)
        if rest:
            decided.update(await _run_rest(idem, context, subscriber, rest))
    except _Outage as exc:
        log.warning("delivery not handed to the handler (%s): it is delivered again", exc)
        return False
    assert isinstance(idem.transport, _Kafka)  # kafka_records() found records
    members = [idem.transport.message_of(record) for record in records]
    await batch.settle_batch(
        idem,
        subscriber,
        _consumer_of(records, subscriber),
        members,
        [decided.get(id(r)) for r in records],
    )
    return True


def kafka_records(idem: Idempotency, raw: Any) -> list[Any]:
    """The records of a Kafka delivery (one, or a batch's); empty for anything else."""
    from consumer_idem.faststream.kafka_side import _Kafka

    records = list(raw) if isinstance(raw, tuple | list) else [raw]
    if not isinstance(idem.transport, _Kafka) or not all(hasattr(r, "offset") for r in records):
        return []
    return records


async def seek_back(idem: Idempotency, subscriber: Any, records: list[Any]) -> None:
    """Deliver each partition of a Kafka delivery again from its first record."""
    from consumer_idem.faststream.kafka_side import _Kafka

    assert isinstance(idem.transport, _Kafka)
    first: dict[tuple[str, int], int] = {}
    for record in map(idem.transport.view, records):
        tp = (record.topic, record.partition)
        first[tp] = min(record.offset, first.get(tp, record.offset))
    await idem.transport.seek(_consumer_of(records, subscriber), first)


def _consumer_of(records: list[Any], subscriber: Any) -> Any:
    """The consumer that fetched ``records``: FastStream's concurrent subscriber has one per
    worker and sets it on each record; the others have one."""
    return getattr(records[0], "consumer", None) or getattr(subscriber, "consumer", None)


async def _refused(
    idem: Idempotency, subscriber: Any, raw: Any, records: list[Any], is_batch: bool
) -> dict[int, Verdict]:
    """The records that cannot run, with their dead-letter verdicts: none when the delivery
    routes; all (``no_handler``) when it parses and no filter accepts it; those refused on
    their own (``unparseable``) when the parser refuses it for bad data."""
    try:
        if await _route(subscriber, raw) is not None:
            return {}
    except DATA_ERRORS:
        pass
    else:
        return {id(r): _dead(idem, "no_handler", "no handler's filter accepts it") for r in records}
    refused: dict[int, Verdict] = {}
    for record in records:
        try:
            await _route(subscriber, (record,) if is_batch else record)
        except DATA_ERRORS as exc:
            refused[id(record)] = _dead(idem, "unparseable", f"{type(exc).__name__}: {exc}")
    return refused


async def _route(subscriber: Any, raw: Any) -> tuple[Any, Any] | None:
    """The first handler accepting ``raw`` and the message it parsed, or None; raises the
    parser's or filter's data error, or `_Outage` for any other."""
    for call in _compat.handler_calls(subscriber):
        try:
            parsed = await _compat.parse_for(call, raw)
        except DATA_ERRORS:
            raise
        except Exception as exc:
            raise _Outage(f"{type(exc).__name__}: {exc}") from exc
        if parsed is not None:
            return call, parsed
    return None


def _dead(idem: Idempotency, reason: str, why: str) -> Verdict:
    return Verdict(Action.DEAD_LETTER, idem.scope, reason=reason, error=why[:1000])


async def _parse_error(subscriber: Any, raw: Any) -> str | None:
    """Why the subscriber's parser refuses ``raw``, or None when it parses."""
    for call in _compat.handler_calls(subscriber):
        try:
            await _compat.parse_for(call, raw)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


async def _run_rest(
    idem: Idempotency, context: Any, subscriber: Any, rest: tuple[Any, ...]
) -> dict[int, Verdict | None]:
    """The verdicts of a batch's parseable records, run through the middleware as the batch
    FastStream would have delivered without the refused ones (unsettled: the caller settles
    every record of the delivery in offset order)."""
    from consumer_idem.faststream.context import _Settled
    from consumer_idem.faststream.middleware import _Middleware

    try:
        found = await _route(subscriber, rest)
    except DATA_ERRORS as exc:  # refused together, though not one by one: wait, do not guess
        raise _Outage(f"{type(exc).__name__}: {exc}") from exc
    if found is None:
        return {id(r): _dead(idem, "no_handler", "no handler's filter accepts it") for r in rest}
    call, parsed = found
    middleware = _Middleware(rest, context=context, idem=idem)
    with contextlib.suppress(_Settled):  # raised by the middleware once it has verdicts
        await _compat.call_with_middleware(call, parsed, middleware.consume_scope)
    verdicts = middleware.verdicts or []
    return {id(r): verdicts[i] if i < len(verdicts) else None for i, r in enumerate(rest)}
