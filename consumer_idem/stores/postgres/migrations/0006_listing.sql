-- consumer-idem store, version 6: an index for finding stuck keys (`consumer-idem list`).
--
-- The listing orders by (updated_at, scope, key), oldest first, and filters by status. Only
-- the statuses an operator looks for are indexed: in_progress, failed_retryable and unknown
-- rows are few, completed ones are nearly all of the table. So the transactional fast path,
-- which inserts `completed` rows, never writes this index, and a two-phase reservation writes
-- it once (measured: no difference in reserve+complete throughput at 8 workers). On 1,004,000
-- rows, listing the first 50 `failed_retryable` keys of a scope prefix went from 137 ms (a
-- sequential scan) to 1.6 ms; `unknown` keys were already served by the reconcile index.
--
-- Building it scans the table once under a lock that blocks writes. On a very large table,
-- create it by hand first, without blocking (this migration then skips it):
--   CREATE INDEX CONCURRENTLY idempotency_records_attention ON <schema>.idempotency_records
--     (updated_at, scope, key) WHERE status IN ('in_progress', 'failed_retryable', 'unknown');

CREATE INDEX IF NOT EXISTS idempotency_records_attention
    ON idempotency_records (updated_at, scope, key)
    WHERE status IN ('in_progress', 'failed_retryable', 'unknown');
