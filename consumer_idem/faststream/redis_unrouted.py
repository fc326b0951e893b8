"""Redis stream entries FastStream could not hand to the handler, dead-lettered instead of
claimed for ever.

FastStream parses an entry and picks the handler whose filter accepts it before any
middleware's handler call runs. When its parser refuses the entry (a field that is not UTF-8
beside no ``__data__`` field, a custom parser's error) or no filter accepts it, FastStream logs
the error and leaves the entry pending. The claiming subscriber then takes it again after every
``min_idle_time``, and the parser refuses it again: a loop with no end, spending no delivery
budget since the handler never runs. So the middleware settles such an entry itself, as on
Kafka (`consumer_idem.faststream.unrouted`):

* an entry the parser refuses for bad data (a ``ValueError``, ``TypeError`` or ``LookupError``)
  is dead-lettered (reason ``unparseable``, with the parser's error), and one no handler's
  filter accepts is dead-lettered too (reason ``no_handler``);
* the dead letter is the entry's own fields, byte for byte (its body cannot be read as a
  message), plus the ``x-dead-letter-*`` fields that say why; the entry is ``XACK``-ed only
  once Redis has the dead letter;
* an entry that routes when tried again, or whose parser fails with any other error (an
  outage, not bad data), or whose dead letter cannot be written now, stays pending: the
  claiming subscriber takes it again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from consumer_idem.faststream import _compat
from consumer_idem.faststream.redis_side import DEAD_LETTER_ENTRY
from consumer_idem.notice import ORIGINAL_QUEUE
from consumer_idem.verdict import DEAD_LETTER_ERROR, DEAD_LETTER_REASON, DEAD_LETTER_SCOPE

if TYPE_CHECKING:
    from consumer_idem.faststream import Idempotency

log = logging.getLogger("consumer_idem.faststream")


def is_stream_entry(raw: Any) -> bool:
    """Is ``raw`` one entry FastStream read from a Redis stream?"""
    return isinstance(raw, dict) and raw.get("type") == "stream" and "message_ids" in raw


async def settle_unrouted(idem: Idempotency, subscriber: Any, raw: Any) -> bool:
    """Dead-letter and ``XACK`` a stream entry that cannot run; False when it is not one to
    settle here (it stays pending, and is claimed again)."""
    from consumer_idem.faststream.unrouted import _Outage, _refused

    group = getattr(getattr(subscriber, "stream_sub", None), "group", None)
    if group is None:
        return False
    try:
        refused = await _refused(idem, subscriber, raw, [raw], False)
    except _Outage as exc:
        log.warning("stream entry not handed to the handler (%s): it stays pending", exc)
        return False
    verdict = refused.get(id(raw))
    if verdict is None:
        return False  # it routes now: the failure was not the entry's
    channel = str(raw["channel"])
    ids: list[bytes] = list(raw["message_ids"])
    fields: dict[Any, Any] = dict(raw["data"])
    fields.update(
        {
            DEAD_LETTER_REASON: verdict.reason or "unknown",
            DEAD_LETTER_ERROR: verdict.error or "",
            DEAD_LETTER_SCOPE: verdict.scope,
            ORIGINAL_QUEUE: channel,
            DEAD_LETTER_ENTRY: b",".join(ids).decode(),
        }
    )
    destination = idem.dead_letter_destination(channel)
    client = _compat.redis_client(idem.broker)
    await client.xadd(destination, fields)  # Redis has the dead letter when it answers
    await client.xack(channel, group, *ids)
    idem.stats.dead_lettered += 1
    idem.stats.processed += 1
    log.warning(
        "scope=%s: stream entry %s of %s dead-lettered to %s: %s (%s)",
        idem.scope,
        fields[DEAD_LETTER_ENTRY],
        channel,
        destination,
        verdict.reason,
        verdict.error,
        extra={"scope": idem.scope},
    )
    return True
