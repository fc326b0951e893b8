-- consumer-idem store, version 9: an outbox row says which run of its unit wrote it and which
-- sender's broker it is for, and a relay finds the due rows of one destination by an index.
--
-- * `run`: one execution of the unit (a random id the claim draws when it takes the key). A
--   key that runs again as new work (its record pruned after the retention, or evicted by an
--   operator) is a new run: its messages get new `idempotency-key`s (the key hashes the run),
--   so the next consumer takes them as new messages. Re-sends of one row keep its stored key.
-- * `route`: the transport and the broker (cluster) of the sender that serves the unit's scope
--   (`kafka:<bootstrap servers>`, `amqp:<host:port>[/<vhost>]`, as the sender states it). A relay
--   claims only rows of its own sender's route, so a Kafka unit's message never goes out
--   through a RabbitMQ relay.
--
-- Rows written before this version have neither: their key stays as it was, and a NULL route
-- is sent only by a relay that names its scopes (`OutboxRelay(..., scopes=[...])`, as the
-- runners do), as before; a relay for every scope (`scopes=None`) leaves them alone. The same
-- holds for a row of a unit that committed in a process with no sender attached for its scope.

ALTER TABLE outbox_messages ADD COLUMN run uuid, ADD COLUMN route text;

-- The relay takes the due rows of each destination in publishing order, destination by
-- destination, skipping a destination that is backing off after a failed send: only the rows
-- not yet sent, so it stays as small as the backlog.
CREATE INDEX outbox_messages_relay
    ON outbox_messages ((coalesce(route, '')), destination, id) WHERE status = 'pending';
