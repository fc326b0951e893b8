"""Kafka consumer offsets kept in Postgres (``KafkaRunner(offsets_in_postgres=True)``).

The next offset to read of each partition is a row of ``<schema>.kafka_offsets`` (migration
0007), keyed by consumer group, topic and partition. The runner writes it in the same
transaction as the effect and the idempotency records of the records it covers (a
`CommitHook`: one more statement in the COMMIT's round trip, no
round trip of its own), and seeks to it when a partition is assigned. A crash between the
Postgres commit and the Kafka offset commit therefore never hands an already-committed record
to the handler again, and Kafka's own committed offsets become advisory (lag monitoring).

Values only grow: every value written says "everything before it is settled", which stays
true, so the greatest is kept, and a consumer that lost the partition but has not noticed yet
cannot move it back.

A number means something only in one log. Each value also names the record just before it
([`record_mark`][consumer_idem.transports.kafka_offsets.record_mark]: its timestamp and a digest of
its key and value, migration 0010), and the
runner trusts a stored offset on assignment only when that record is still there
(``consumer_idem.transports.kafka_offset_check``): a topic deleted and created again under its
name, or a mirror cluster, starts at Kafka's committed offset instead, and its row is dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from consumer_idem.message import ConsumerMessage
from consumer_idem.stores.postgres.fast_path import dollar_quote
from consumer_idem.stores.postgres.store import PostgresStore

#: (topic, partition)
Partition = tuple[str, int]
#: a partition's stored position: the next offset, and the mark of the record before it (None
#: on rows written before migration 0010)
Stored = tuple[int, str | None]


def record_mark(record: Any) -> str:
    """What identifies a record of a partition's log beyond its offset: its timestamp and a
    digest of its key and value (``record``: an aiokafka ``ConsumerRecord``)."""
    digest = hashlib.blake2b(digest_size=12)
    for part in (record.key, record.value):
        data = b"" if part is None else bytes(part)
        digest.update(len(data).to_bytes(8, "big") if part is not None else b"\xff" * 8)
        digest.update(data)
    return f"{int(record.timestamp)}:{digest.hexdigest()}"


class PostgresOffsets:
    """The offsets of consumer group ``group_id`` in ``store``'s schema."""

    def __init__(self, store: PostgresStore, group_id: str) -> None:
        self.store = store
        self.group_id = group_id
        self.table = f'"{store.schema}".kafka_offsets'

    def statement(self, topic: str, partition: int, next_offset: int, mark: str | None) -> str:
        """The upsert of one partition's next offset (and the mark of the record before it) as
        literal SQL (simple protocol, so it can travel in the round trip of a COMMIT; text is
        dollar-quoted, numbers are ``int``)."""
        return self._upsert(self._values(topic, partition, next_offset, mark))

    def _values(self, topic: str, partition: int, next_offset: int, mark: str | None) -> str:
        quoted = "NULL" if mark is None else dollar_quote(mark)
        return (
            f"({dollar_quote(self.group_id)}, {dollar_quote(topic)}, {int(partition)},"
            f" {int(next_offset)}, {quoted})"
        )

    def _upsert(self, values: str) -> str:
        # the mark goes with the offset it was written with (SET reads the old row's values)
        return (
            f"INSERT INTO {self.table} AS o (group_id, topic, partition, next_offset,"
            f" last_record) VALUES {values} ON CONFLICT (group_id, topic, partition) DO UPDATE"
            " SET next_offset = GREATEST(o.next_offset, EXCLUDED.next_offset),"
            " last_record = CASE WHEN EXCLUDED.next_offset >= o.next_offset"
            " THEN EXCLUDED.last_record ELSE o.last_record END,"
            " updated_at = now()"
        )

    async def save(self, offsets: Mapping[Partition, Stored]) -> None:
        """Write next offsets (with the marks of the records before them) now, in a
        transaction of their own (records that were settled without a transaction of ours:
        dead letters, notices, duplicates). Raises the store's error
        ([`StoreUnavailable`][consumer_idem.errors.StoreUnavailable]...) when it cannot."""
        if not offsets:
            return
        values = ", ".join(
            self._values(topic, partition, offset, mark)
            for (topic, partition), (offset, mark) in sorted(offsets.items())
        )
        sql = self._upsert(values)
        await self.store.run(
            "save_offsets",
            "",
            None,
            lambda c: c.execute(sql, timeout=self.store.command_timeout),
        )

    async def load(self, partitions: Iterable[Partition]) -> dict[Partition, Stored]:
        """The stored next offsets of ``partitions``, with the marks of the records before them
        (those the group never stored are absent)."""
        wanted = sorted(set(partitions))
        if not wanted:
            return {}
        sql = (
            f"SELECT topic, partition, next_offset, last_record FROM {self.table}"
            " WHERE group_id = $1 AND (topic, partition) IN"
            " (SELECT * FROM unnest($2::text[], $3::int[]))"
        )
        rows = await self.store.run(
            "load_offsets",
            "",
            None,
            lambda c: c.fetch(
                sql,
                self.group_id,
                [t for t, _ in wanted],
                [p for _, p in wanted],
                timeout=self.store.command_timeout,
            ),
        )
        return {(r["topic"], r["partition"]): (r["next_offset"], r["last_record"]) for r in rows}

    async def forget(self, partition: Partition, stored: Stored) -> None:
        """Drop a partition's row that belongs to another log (a topic created again under its
        name, another cluster), if it still holds what was read: the group's next writes, lower
        numbers of the new log, must not be outgrown by the old ones."""
        topic, number = partition
        offset, mark = stored
        sql = (
            f"DELETE FROM {self.table} WHERE group_id = $1 AND topic = $2 AND partition = $3"
            " AND next_offset = $4 AND last_record IS NOT DISTINCT FROM $5"
        )
        await self.store.run(
            "forget_offset",
            "",
            None,
            lambda c: c.execute(
                sql, self.group_id, topic, number, offset, mark, timeout=self.store.command_timeout
            ),
        )


class OffsetHook:
    """The `CommitHook` of one partition: the statement that
    stores ``upto.offset + 1``, and, once committed, the runner's note of what Postgres holds."""

    def __init__(self, offsets: PostgresOffsets, stored: dict[Partition, int]) -> None:
        self.offsets = offsets
        #: (topic, partition) -> next offset known to be committed in Postgres
        self.stored = stored

    def statement(self, upto: ConsumerMessage) -> str:
        assert upto.topic is not None and upto.partition is not None and upto.offset is not None
        mark = None if upto.raw is None else record_mark(upto.raw)  # (a test's bare message)
        return self.offsets.statement(upto.topic, upto.partition, upto.offset + 1, mark)

    def committed(self, upto: ConsumerMessage) -> None:
        assert upto.topic is not None and upto.partition is not None and upto.offset is not None
        tp = (upto.topic, upto.partition)
        self.stored[tp] = max(self.stored.get(tp, 0), upto.offset + 1)
