"""Kafka consumer offsets kept in Postgres (``KafkaRunner(offsets_in_postgres=True)``).

The next offset to read of each partition is a row of ``<schema>.kafka_offsets`` (migration
0007), keyed by consumer group, topic and partition. The runner writes it in the same
transaction as the effect and the idempotency records of the records it covers (a
:class:`~consumer_idem.consumer.CommitHook`: one more statement in the COMMIT's round trip, no
round trip of its own), and seeks to it when a partition is assigned. A crash between the
Postgres commit and the Kafka offset commit therefore never hands an already-committed record
to the handler again, and Kafka's own committed offsets become advisory (lag monitoring).

Values only grow: every value written says "everything before it is settled", which stays
true, so the greatest is kept, and a consumer that lost the partition but has not noticed yet
cannot move it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from consumer_idem.message import ConsumerMessage
from consumer_idem.stores.postgres.fast_path import dollar_quote
from consumer_idem.stores.postgres.store import PostgresStore

#: (topic, partition)
Partition = tuple[str, int]


class PostgresOffsets:
    """The offsets of consumer group ``group_id`` in ``store``'s schema."""

    def __init__(self, store: PostgresStore, group_id: str) -> None:
        self.store = store
        self.group_id = group_id
        self.table = f'"{store.schema}".kafka_offsets'

    def statement(self, topic: str, partition: int, next_offset: int) -> str:
        """The upsert of one partition's next offset as literal SQL (simple protocol, so it can
        travel in the round trip of a COMMIT; text is dollar-quoted, numbers are ``int``)."""
        values = (
            f"({dollar_quote(self.group_id)}, {dollar_quote(topic)}, {int(partition)},"
            f" {int(next_offset)})"
        )
        return self._upsert(values)

    def _upsert(self, values: str) -> str:
        return (
            f"INSERT INTO {self.table} AS o (group_id, topic, partition, next_offset)"
            f" VALUES {values} ON CONFLICT (group_id, topic, partition) DO UPDATE"
            " SET next_offset = GREATEST(o.next_offset, EXCLUDED.next_offset),"
            " updated_at = now()"
        )

    async def save(self, offsets: Mapping[Partition, int]) -> None:
        """Write next offsets now, in a transaction of their own (records that were settled
        without a transaction of ours: dead letters, notices, duplicates). Raises the store's
        error (:class:`~consumer_idem.errors.StoreUnavailable`...) when it cannot."""
        if not offsets:
            return
        values = ", ".join(
            f"({dollar_quote(self.group_id)}, {dollar_quote(topic)}, {int(partition)},"
            f" {int(offset)})"
            for (topic, partition), offset in sorted(offsets.items())
        )
        sql = self._upsert(values)
        await self.store.run(
            "save_offsets",
            "",
            None,
            lambda c: c.execute(sql, timeout=self.store.command_timeout),
        )

    async def load(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """The stored next offsets of ``partitions`` (those the group never stored are absent)."""
        wanted = sorted(set(partitions))
        if not wanted:
            return {}
        sql = (
            f"SELECT topic, partition, next_offset FROM {self.table}"
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
        return {(r["topic"], r["partition"]): r["next_offset"] for r in rows}


class OffsetHook:
    """The :class:`~consumer_idem.consumer.CommitHook` of one partition: the statement that
    stores ``upto.offset + 1``, and, once committed, the runner's note of what Postgres holds."""

    def __init__(self, offsets: PostgresOffsets, stored: dict[Partition, int]) -> None:
        self.offsets = offsets
        #: (topic, partition) -> next offset known to be committed in Postgres
        self.stored = stored

    def statement(self, upto: ConsumerMessage) -> str:
        assert upto.topic is not None and upto.partition is not None and upto.offset is not None
        return self.offsets.statement(upto.topic, upto.partition, upto.offset + 1)

    def committed(self, upto: ConsumerMessage) -> None:
        assert upto.topic is not None and upto.partition is not None and upto.offset is not None
        tp = (upto.topic, upto.partition)
        self.stored[tp] = max(self.stored.get(tp, 0), upto.offset + 1)
