-- consumer-idem store, version 1.
-- Applied by consumer_idem.stores.postgres.migrate with search_path set to the configured schema, so nothing
-- here names the schema. One row per (scope, key); see docs/design.md for the state machine.

CREATE TABLE idempotency_records (
    scope                   text        NOT NULL,
    key                     text        NOT NULL,
    fingerprint             text        NOT NULL,
    status                  text        NOT NULL
        CHECK (status IN ('in_progress', 'completed', 'failed_retryable', 'unknown', 'expired')),
    owner_token             uuid,
    locked_until            timestamptz,
    attempts                integer     NOT NULL DEFAULT 1,
    -- `json`, not `jsonb`: json keeps the stored text as written, so a replay is byte-identical.
    result                  json,
    result_kind             text CHECK (result_kind IN ('success', 'domain_error')),
    http_status             integer,
    http_headers            jsonb,
    http_body               bytea,
    last_error              text,
    reconcile_after         timestamptz,
    reconcile_attempts      integer     NOT NULL DEFAULT 0,
    reconcile_published_at  timestamptz,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    completed_at            timestamptz,
    expires_at              timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    -- an in_progress row always has an owner and a lease; no other state has an owner
    CHECK ((status = 'in_progress') = (owner_token IS NOT NULL AND locked_until IS NOT NULL))
);

-- The sweeper looks for expired leases.
CREATE INDEX idempotency_records_leases
    ON idempotency_records (locked_until) WHERE status = 'in_progress';
-- Reconciliation looks for due unknown rows.
CREATE INDEX idempotency_records_reconcile
    ON idempotency_records (reconcile_after) WHERE status = 'unknown';
-- Pruning walks expired rows in small batches.
CREATE INDEX idempotency_records_expiry ON idempotency_records (expires_at);

-- reserve: the one entry point that decides what a delivery may do. Returns one row:
--   decision: execute | replay | in_progress | misuse | unknown
--   zombie:   true when this call found an expired lease and parked the row as unknown
--   rec:      the row after the decision
-- Claiming uses INSERT .. ON CONFLICT DO NOTHING, so a duplicate racing an uncommitted claim
-- waits on the unique index and then sees the winner's committed row (READ COMMITTED gives each
-- statement of this VOLATILE function a fresh snapshot). Re-acquiring and parking are
-- conditional UPDATEs: of several racers exactly one matches, the others re-read and decide again.
CREATE FUNCTION reserve(
    p_scope text, p_key text, p_fingerprint text, p_token uuid,
    p_lease interval, p_retention interval
) RETURNS TABLE (decision text, zombie boolean, rec idempotency_records)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    r idempotency_records;
BEGIN
    FOR i IN 1..10 LOOP
        INSERT INTO idempotency_records AS t
            (scope, key, fingerprint, status, owner_token, locked_until, attempts, expires_at)
        VALUES (p_scope, p_key, p_fingerprint, 'in_progress', p_token,
                clock_timestamp() + p_lease, 1, now() + p_retention)
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING * INTO r;
        IF FOUND THEN
            RETURN QUERY SELECT 'execute'::text, false, r;
            RETURN;
        END IF;

        SELECT * INTO r FROM idempotency_records t WHERE t.scope = p_scope AND t.key = p_key;
        IF NOT FOUND THEN
            CONTINUE;  -- evicted or pruned between the two statements: claim again
        END IF;

        IF r.status = 'expired' THEN
            -- past retention the key carries no memory: it is new work, whatever its payload
            UPDATE idempotency_records t
               SET fingerprint = p_fingerprint, status = 'in_progress', owner_token = p_token,
                   locked_until = clock_timestamp() + p_lease, attempts = 1,
                   result = NULL, result_kind = NULL, http_status = NULL, http_headers = NULL,
                   http_body = NULL, last_error = NULL, reconcile_after = NULL,
                   reconcile_attempts = 0, reconcile_published_at = NULL, created_at = now(),
                   updated_at = now(), completed_at = NULL, expires_at = now() + p_retention
             WHERE t.scope = p_scope AND t.key = p_key AND t.status = 'expired'
            RETURNING * INTO r;
            IF FOUND THEN
                RETURN QUERY SELECT 'execute'::text, false, r;
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF r.fingerprint <> p_fingerprint THEN
            RETURN QUERY SELECT 'misuse'::text, false, r;
            RETURN;
        END IF;

        IF r.status = 'completed' THEN
            RETURN QUERY SELECT 'replay'::text, false, r;
            RETURN;
        ELSIF r.status = 'unknown' THEN
            RETURN QUERY SELECT 'unknown'::text, false, r;
            RETURN;
        ELSIF r.status = 'failed_retryable' THEN
            UPDATE idempotency_records t
               SET status = 'in_progress', owner_token = p_token,
                   locked_until = clock_timestamp() + p_lease, attempts = t.attempts + 1,
                   updated_at = now()
             WHERE t.scope = p_scope AND t.key = p_key AND t.status = 'failed_retryable'
               AND t.fingerprint = p_fingerprint
            RETURNING * INTO r;
            IF FOUND THEN
                RETURN QUERY SELECT 'execute'::text, false, r;
                RETURN;
            END IF;
            CONTINUE;  -- another reserver won it: decide again on its row
        ELSIF r.status = 'in_progress' THEN
            IF r.locked_until < clock_timestamp() THEN
                -- the owner vanished mid-flight: it may have acted, so never re-run; park it
                UPDATE idempotency_records t
                   SET status = 'unknown', owner_token = NULL, locked_until = NULL,
                       last_error = 'lease_expired', reconcile_after = now(),
                       reconcile_published_at = NULL, updated_at = now()
                 WHERE t.scope = p_scope AND t.key = p_key AND t.status = 'in_progress'
                   AND t.owner_token = r.owner_token AND t.locked_until < clock_timestamp()
                RETURNING * INTO r;
                IF FOUND THEN
                    RETURN QUERY SELECT 'unknown'::text, true, r;
                    RETURN;
                END IF;
                CONTINUE;
            END IF;
            RETURN QUERY SELECT 'in_progress'::text, false, r;
            RETURN;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'consumer_idem.reserve: record (%, %) changed under every attempt', p_scope, p_key;
END
$$;
