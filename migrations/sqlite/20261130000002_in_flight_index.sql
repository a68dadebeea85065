-- The keys each tenant holds in flight, for the per-tenant limit of in-flight
-- keys (IDEMGATE_TENANT_MAX_IN_FLIGHT): counting a tenant's live leases reads
-- only these entries.
CREATE INDEX IF NOT EXISTS idempotency_keys_in_flight
    ON idempotency_keys (tenant, lease_expires_at)
    WHERE state = 'in_flight';
