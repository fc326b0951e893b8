-- consumer-idem store, version 3: originals kept for unknown outcomes, and a re-dispatch bound.
--
-- A delivery whose outcome is `unknown` (parked now, or met) is acked only once its original
-- message is stored here, *unarmed* (due_at NULL: held until the record is resolved). The
-- resolution arms it in the same transaction ("not executed": due now, the sweeper sends it)
-- or deletes it ("executed"). So a key parked `unknown` never loses the only copy of its work,
-- whichever delivery acked it (a duplicate meeting `unknown`, a dead-letter replay, the next
-- owner after a crash or a cancellation).
--
-- A re-dispatch restores what the key strategies read: the AMQP properties (message_id,
-- correlation_id, content_type...) and the Kafka record key; the original coordinates travel
-- as x-original-* headers.

ALTER TABLE redispatch_outbox ALTER COLUMN due_at DROP NOT NULL;
ALTER TABLE redispatch_outbox ADD COLUMN record_key bytea;
ALTER TABLE redispatch_outbox ADD COLUMN properties jsonb NOT NULL DEFAULT '{}'::jsonb;

-- How many times reconciliation re-dispatched this key ("not executed", and each re-run ended
-- unknown again). Past the reconciler's max_redispatches the case goes to the operator.
ALTER TABLE idempotency_records ADD COLUMN redispatches integer NOT NULL DEFAULT 0;
