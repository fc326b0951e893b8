-- consumer-idem store, version 8: every statement on one key finds it by its primary key,
-- whatever the statistics say.
--
-- The partial indexes (leases, reconciliation, the listing of migration 6) hold an entry for
-- each row that was ever in their state, until a vacuum removes the dead ones: every two-phase
-- claim adds one to the leases and listing indexes, and its completion leaves it dead. The
-- planner prices an index by the live entries of the last vacuum (next to none: nearly every
-- row is completed), so for an UPDATE of one key with a status condition
-- (`WHERE scope = $1 AND key = $2 AND status = 'unknown'`) a partial index whose predicate
-- the condition implies looks cheaper than the primary key, and was chosen: the listing index,
-- whose (scope, key) columns come second, was walked whole. Measured on a store of 5 million
-- rows: each completion scanned every entry added since the load, and reserve + complete fell
-- from 1,517 to 810 a second within a minute (the empty store, vacuumed often, did not).
--
-- So a partial index is now only usable by the statements it is for:
-- * statements on one key never say `status = 'in_progress'`: the owner token says it (the
--   table's CHECK ties a token to that status), so the leases index is not implied; here, the
--   reservation's parking of an expired lease;
-- * the reconciliation index also requires `reconcile_after IS NOT NULL`, which the due scan
--   implies (`reconcile_after <= now()`) and a resolution of one key does not;
-- * the listing index also requires `updated_at > '-infinity'` (always true), which the
--   listing and the count of unknown records state and nothing else does. Not `IS NOT NULL`:
--   PostgreSQL 17 and later drop that test from a query on a NOT NULL column, and the index
--   would then serve nothing.
--
-- Building the two indexes scans the table once under a lock that blocks writes, and dropping
-- the old ones takes a lock that also blocks reads, for as long as the longest transaction
-- open on the table. On a very large or busy table, do both by hand first, without blocking
-- (this migration then skips them; an index left INVALID by a failed build is rebuilt here):
--   CREATE INDEX CONCURRENTLY idempotency_records_listing ON <schema>.idempotency_records
--     (updated_at, scope, key)
--     WHERE status IN ('in_progress', 'failed_retryable', 'unknown')
--       AND updated_at > '-infinity';
--   CREATE INDEX CONCURRENTLY idempotency_records_reconcile_due
--     ON <schema>.idempotency_records (reconcile_after)
--     WHERE status = 'unknown' AND reconcile_after IS NOT NULL;
--   DROP INDEX CONCURRENTLY <schema>.idempotency_records_attention;
--   DROP INDEX CONCURRENTLY <schema>.idempotency_records_reconcile;

DO $$
DECLARE
    name text;
BEGIN
    -- a CONCURRENTLY build that failed leaves an INVALID index under the name: never skip it
    FOR name IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid
           AND c.relname IN ('idempotency_records_listing', 'idempotency_records_reconcile_due')
    LOOP
        EXECUTE format('DROP INDEX %I', name);
    END LOOP;
END
$$;

CREATE INDEX IF NOT EXISTS idempotency_records_listing
    ON idempotency_records (updated_at, scope, key)
    WHERE status IN ('in_progress', 'failed_retryable', 'unknown') AND updated_at > '-infinity';
DROP INDEX IF EXISTS idempotency_records_attention;

CREATE INDEX IF NOT EXISTS idempotency_records_reconcile_due
    ON idempotency_records (reconcile_after)
    WHERE status = 'unknown' AND reconcile_after IS NOT NULL;
DROP INDEX IF EXISTS idempotency_records_reconcile;

-- Unchanged from version 4 but for the parking of an expired lease, fenced by its token alone.
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
                 WHERE t.scope = p_scope AND t.key = p_key AND t.owner_token = r.owner_token
                   AND t.locked_until < clock_timestamp()
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

