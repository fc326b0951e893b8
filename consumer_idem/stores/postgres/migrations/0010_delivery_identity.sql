-- consumer-idem store, version 10: what a delivery's history is tied to.
--
-- 1. Kafka offsets kept in Postgres remember which record they follow. A stored next offset N
--    says "everything before N is settled" of one partition's log; a topic deleted and
--    created again under its name (or a fail-over to a mirror cluster) is another log whose
--    offsets mean other records. `last_record` holds the timestamp and a digest of the record
--    at N - 1; on assignment the runner reads that offset of the partition and trusts N only
--    when the same record is there (or when N is not past the start of the log, where nothing
--    can be skipped). A NULL (a row written before this version) is checked against the log
--    end only, and filled in by the next write.
--
-- 2. RabbitMQ delivery budgets count the attempts that ran the handler for a key, not the
--    broker's returns: a consumer killed by one message returns every unacked delivery of its
--    channel, and the broker counts them all. A delivery the broker delivered before adds one
--    here, in its own committed statement, right before its handler runs; the runner
--    dead-letters at `max_deliveries` only after it has read the key's record.

ALTER TABLE kafka_offsets ADD COLUMN last_record text;

CREATE TABLE delivery_attempts (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    attempts    integer     NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key)
);
-- pruning walks it by age
CREATE INDEX delivery_attempts_updated ON delivery_attempts (updated_at);
