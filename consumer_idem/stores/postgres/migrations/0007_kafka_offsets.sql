-- consumer-idem store, version 7: Kafka consumer offsets kept in Postgres (opt-in:
-- `KafkaRunner(offsets_in_postgres=True)`).
--
-- The next offset to read of each partition a consumer group consumes. The runner writes it in
-- the same transaction as the effect and the idempotency records of the records it covers
-- (one statement in the COMMIT's round trip), and, for records settled otherwise (a dead
-- letter, a notice, a duplicate), right after they are settled. On assignment the runner seeks
-- to it, so a crash between the Postgres commit and the Kafka offset commit does not hand an
-- already-committed record to the handler again. Kafka's own committed offsets are then only
-- advisory (lag monitoring). A value only grows (GREATEST): every value written is true ("all
-- before it is settled"), so a late writer whose partition has moved on cannot move it back.
-- To rewind a group, update or delete its rows here while it is stopped.

CREATE TABLE kafka_offsets (
    group_id     text        NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    next_offset  bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition)
);
