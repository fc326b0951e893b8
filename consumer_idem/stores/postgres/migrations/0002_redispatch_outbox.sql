-- consumer-idem store, version 2: the re-dispatch outbox.
-- When reconciliation answers "not executed", the record becomes failed_retryable and the
-- original message must be sent again to run once. The row here is written in the same
-- transaction as that resolution, so a crash before the message is re-sent cannot lose the
-- work: the sweeper re-sends every row still here once it is due. A row is deleted once the
-- broker confirmed the re-dispatch.

CREATE TABLE redispatch_outbox (
    id          bigserial   PRIMARY KEY,
    scope       text        NOT NULL,
    key         text        NOT NULL,
    -- where the original message came from (topic or queue), its body and headers
    source      text        NOT NULL,
    body        bytea       NOT NULL,
    header_names   text[]   NOT NULL DEFAULT '{}',
    header_values  bytea[]  NOT NULL DEFAULT '{}',
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    due_at      timestamptz NOT NULL DEFAULT now(),
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (scope, key)
);

-- The sweeper looks for due rows.
CREATE INDEX redispatch_outbox_due ON redispatch_outbox (due_at);
