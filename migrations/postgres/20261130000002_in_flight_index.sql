-- The keys each tenant holds in flight, for the per-tenant limit of in-flight
-- keys (IDEMGATE_TENANT_MAX_IN_FLIGHT): counting a tenant's live leases reads
-- only these entries, never the tenant's completed records.
--
-- A plain CREATE INDEX, inside the migration's transaction: on a large table
-- it holds writes back while it builds. CONCURRENTLY would not, but it cannot
-- run in a transaction and would wait on the other processes queued behind
-- the migration lock.
CREATE INDEX IF NOT EXISTS idempotency_keys_in_flight
    ON idempotency_keys (tenant, lease_expires_at)
    WHERE state = 'in_flight';
