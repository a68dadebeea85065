-- The rows in flight now marked `limited` (20261210000001_heap_only_commit.sql):
-- the claims from before the functions wrote it count in the tenant limit
-- as before. After step 1, so that every claim since writes the column
-- itself; a row marked that has no limit is only read more (the count checks
-- each row's state and lease).
--
-- Row locks only, on the rows in flight, found through
-- idempotency_keys_in_flight (dropped in step 3, once this has run); the
-- lock_timeout bounds how long it waits on a row a commit is writing, and
-- `idemgate migrate` runs it again when it gives up.
SET LOCAL lock_timeout = '500ms';
SET LOCAL statement_timeout = '30s';

DO $migration$
BEGIN
    EXECUTE $$UPDATE idempotency_keys SET limited = true
               WHERE state = 'in_flight' AND NOT limited$$;
END
$migration$;
