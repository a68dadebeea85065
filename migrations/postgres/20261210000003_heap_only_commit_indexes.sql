-- no-transaction
--
-- The indexes of 20261210000001_heap_only_commit.sql, built and dropped
-- CONCURRENTLY: writes go on while each is built, whatever the table's size
-- (SPEC §14). Outside a transaction (the first line), one statement at a
-- time: `idemgate migrate` sends each statement of a step marked so on its
-- own (src/store/postgres/migrate.rs), without a statement_timeout, and
-- before each CREATE INDEX CONCURRENTLY drops an index of that name that an
-- interrupted build left INVALID (IF NOT EXISTS would keep it, unusable),
-- or skips the statement if the index is built and valid. Every statement
-- may run again: the step is recorded once all have run.
--
-- On Citus each statement reaches every shard of the distributed table.
--
-- No lock_timeout nor statement_timeout, on purpose (the linter asks for
-- both): a build CONCURRENTLY takes a SHARE UPDATE EXCLUSIVE lock, which
-- writes pass, then waits for the transactions older than it; a timeout
-- would only cut it half-way and leave an invalid index to build again, and
-- on a large table a build takes longer than any timeout fit for a request.
-- squawk-ignore-file require-lock-timeout, require-statement-timeout

CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_limited
    ON idempotency_keys (tenant, lease_expires_at) WHERE limited;

CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_lease_end
    ON idempotency_keys (lease_expires_at);

CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_marked_unknown
    ON idempotency_keys (unknown_at) WHERE unknown_at IS NOT NULL;

-- The limit's count reads idempotency_keys_limited from here on; no
-- statement names the indexes below.
DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_in_flight;

DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_unknown;
