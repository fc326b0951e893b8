-- consumer-idem store, version 11: the relay finds a destination that is backing off by an
-- index lookup.
--
-- A destination is held while one of its messages waits out the backoff of a failed send: the
-- relay skips it in its query, so that it never takes the place of one that can be sent. This
-- index holds only the pending messages that failed (a due time set), by destination and due
-- time, so that the relay looks a destination up instead of reading its messages.

CREATE INDEX IF NOT EXISTS outbox_messages_held
    ON outbox_messages ((coalesce(route, '')), destination, due_at)
    WHERE status = 'pending' AND due_at IS NOT NULL;
