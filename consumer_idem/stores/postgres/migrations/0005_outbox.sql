-- consumer-idem store, version 5: the transactional outbox (outgoing messages of a unit).
--
-- Not the re-dispatch outbox of version 2 (originals of `unknown` records, re-sent by the
-- reconciler): these are the messages a handler publishes through `outbox_for(conn)`. Each row
-- is inserted in the same transaction as the handler's effect and its idempotency record, so
-- it exists exactly when the unit committed. Right after the COMMIT the process that ran the
-- unit sends it and marks it `sent`; a relay (`FOR UPDATE SKIP LOCKED`, any number of
-- processes) sends the rows a crash or an outage left `pending` once they are due; a
-- message the broker refuses for good is `parked` with its reason for an operator.

CREATE TABLE outbox_messages (
    -- insertion order: a unit's messages get increasing ids in the order they were published
    id               bigserial   PRIMARY KEY,
    -- the unit that published it: the incoming (scope, key) and the message's place in it
    scope            text        NOT NULL,
    unit_key         text        NOT NULL,
    position         integer     NOT NULL,
    -- where it goes (topic or queue), its record key (Kafka), body and headers
    destination      text        NOT NULL,
    message_key      bytea,
    body             bytea       NOT NULL,
    header_names     text[]      NOT NULL DEFAULT '{}',
    header_values    bytea[]     NOT NULL DEFAULT '{}',
    -- the `idempotency-key` header it carries: derived from scope, unit_key and position
    idempotency_key  text        NOT NULL,
    status           text        NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'sent', 'parked')),
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    -- after a failed send: when it may be tried again. NULL until then: a relay takes a fresh
    -- message once it is older than the relay's grace period (the committing process sends it)
    due_at           timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    parked_at        timestamptz
);

-- The one index besides the key, over the few rows not yet sent (most are sent within
-- milliseconds of their commit): the committing process marks its messages sent by their unit
-- coordinates, a relay holds back a message while an earlier one of its unit is pending, and
-- relays and operators scan what is pending or parked.
CREATE INDEX outbox_messages_unsent
    ON outbox_messages (scope, unit_key, position) WHERE status IN ('pending', 'parked');
-- Pruning finds sent rows past the retention by their age: a block-range index, next to nothing
-- to maintain on insert, that lets a pass with nothing old enough skip the table.
CREATE INDEX outbox_messages_age ON outbox_messages USING brin (created_at);
