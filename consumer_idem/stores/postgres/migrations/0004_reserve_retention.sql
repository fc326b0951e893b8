-- consumer-idem store, version 4: a re-acquired key lives its full retention again, and a
-- reservation that loses every race is a wait, not an error.
--
-- * Re-acquiring a `failed_retryable` key extends `expires_at` to at least now + retention:
--   a key that keeps failing (or is retried late) is never pruned between two attempts, which
--   would reset its attempt count. The same holds in Python for `record_failure` and for a
--   "not executed" resolution.
-- * `reserve` gives up after 10 rounds only under extreme contention on one key (each round
--   lost to a concurrent insert, eviction or re-acquisition). It now raises SQLSTATE 40001
--   (serialization_failure), which the library treats as an outage to wait out, instead of
--   P0001, which it would have treated as data the database refuses (a dead letter).

CREATE OR REPLACE FUNCTION reserve(
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
                   updated_at = now(), expires_at = greatest(t.expires_at, now() + p_retention)
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
    -- contention, not bad data: a transient SQLSTATE, so callers wait and try again
    RAISE EXCEPTION 'consumer_idem.reserve: record (%, %) changed under every attempt',
        p_scope, p_key USING ERRCODE = 'serialization_failure';
END
$$;
