"""Whether an offset stored in Postgres still belongs to the partition's log.

A stored next offset N says "everything before N is settled" of one log. A topic deleted and
created again under its name, or a consumer group moved to a mirror cluster, is another log:
its offsets number other records, and seeking to N would skip the first N of them without a
word. Kafka's topic ids would tell the two apart, but aiokafka does not expose them, so the
log is asked directly, on assignment:

* N past the log's end: not this log (its end only grows).
* N at or before the log's start: nothing before it can be skipped; start at the log's start.
* otherwise the record at N - 1 must be the one the offset was written after (its mark:
  timestamp and digest, [`record_mark`][consumer_idem.transports.kafka_offsets.record_mark]), read
  with a short-lived consumer of no group.

A stored offset that fails is not used: the partition starts at Kafka's committed offset (which
Kafka drops with the topic) or the reset policy, a warning names it, and the
``stored_offset_discarded`` counter goes up. A compacted-away or unreadable record counts as a
failure: starting at Kafka's committed offset can only read records again, which their keys
turn into replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from consumer_idem.errors import ConsumerIdemError
from consumer_idem.transports.kafka_offsets import (
    Partition,
    PostgresOffsets,
    Stored,
    record_mark,
)

log = logging.getLogger("consumer_idem.transports.kafka")

#: how long the check waits for the records it reads
READ_TIMEOUT = 10.0


async def start_positions(
    kafka: AIOKafkaConsumer,
    offsets: PostgresOffsets,
    stored: Mapping[Partition, Stored],
    probe_options: dict[str, Any],
    scope: str,
) -> dict[Partition, int]:
    """Where to start the partitions whose offsets ``stored`` holds (the others start where
    Kafka says). A stored offset of another log is logged, counted
    (``stored_offset_discarded``) and its row dropped: the new log's lower numbers must be
    stored from now on. When the logs cannot be asked, none is used."""
    if not stored:
        return {}
    try:
        positions, refused = await trusted_positions(kafka, stored, probe_options)
    except Exception as exc:  # Kafka's committed offsets are never ahead of ours: replays
        log.error(
            "could not check the stored offsets of %s against their logs (%r): starting at "
            "Kafka's committed offsets; records after them are replayed by their keys",
            sorted(stored),
            exc,
        )
        return {}
    for (topic, partition), why in refused.items():
        log.warning(
            "the offset stored in Postgres for %s[%d] is not used: %s (the topic was created "
            "again, or this is another cluster); starting at Kafka's committed offset",
            topic,
            partition,
            why,
        )
        offsets.store.metrics.inc("stored_offset_discarded", scope)
        try:
            await offsets.forget((topic, partition), stored[(topic, partition)])
        except ConsumerIdemError as exc:  # checked again at the next assignment
            log.warning("could not drop the stored offset of %s[%d]: %s", topic, partition, exc)
    return positions


async def trusted_positions(
    kafka: AIOKafkaConsumer,
    stored: Mapping[Partition, Stored],
    probe_options: dict[str, Any],
) -> tuple[dict[Partition, int], dict[Partition, str]]:
    """The positions to start at, from the stored offsets that belong to the partitions' logs,
    and why each of the others does not (``kafka``: the runner's consumer, for the log's
    bounds; ``probe_options``: how to connect a consumer of no group)."""
    tps = [TopicPartition(t, p) for t, p in stored]
    starts = await kafka.beginning_offsets(tps)
    ends = await kafka.end_offsets(tps)
    positions: dict[Partition, int] = {}
    refused: dict[Partition, str] = {}
    to_read: dict[Partition, tuple[int, str]] = {}
    for tp in tps:
        key = (tp.topic, tp.partition)
        offset, mark = stored[key]
        start, end = starts[tp], ends[tp]
        if offset > end:
            refused[key] = f"stored offset {offset} is past the log's end {end}"
        elif offset <= start or mark is None:
            positions[key] = max(offset, start)
        else:
            to_read[key] = (offset - 1, mark)
    if to_read:
        found = await _records_at({k: o for k, (o, _) in to_read.items()}, probe_options)
        for key, (at, mark) in to_read.items():
            seen = found.get(key)
            if seen == mark:
                positions[key] = at + 1
            else:
                refused[key] = (
                    f"the record at offset {at} is not the one the stored offset follows"
                    f" ({'none read' if seen is None else 'another record'})"
                )
    return positions, refused


async def _records_at(
    wanted: dict[Partition, int], options: dict[str, Any]
) -> dict[Partition, str]:
    """The marks of the records at the ``wanted`` offsets (absent: not there, or not read in
    time), read by a consumer of no group (it commits nothing and joins nothing)."""
    probe = AIOKafkaConsumer(
        **{**options, "group_id": None, "enable_auto_commit": False, "auto_offset_reset": "none"}
    )
    marks: dict[Partition, str] = {}
    await probe.start()
    try:
        tps = {key: TopicPartition(*key) for key in wanted}
        probe.assign(list(tps.values()))
        for key, tp in tps.items():
            probe.seek(tp, wanted[key])
        left = set(wanted)
        deadline = asyncio.get_running_loop().time() + READ_TIMEOUT
        while left:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            with contextlib.suppress(Exception):  # out of range: nothing there to match
                batch = await probe.getmany(timeout_ms=int(min(remaining, 1.0) * 1000))
                for tp, records in batch.items():
                    key = (tp.topic, tp.partition)
                    if key in left and records:
                        left.discard(key)
                        first = records[0]
                        if first.offset == wanted[key]:
                            marks[key] = record_mark(first)
                        probe.pause(tp)
    finally:
        await probe.stop()
    return marks
