-- One key per iteration: a reservation and its commit, each its own
-- transaction (the shape of idemgate's reserve + commit, simplified).
INSERT INTO idempotency_keys (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, created_at, expires_at) VALUES ('pgbench', sha256(random()::text::bytea), 'fp', 'in_flight', gen_random_uuid(), now() + interval '30 s', 1, now(), now() + interval '1 day') RETURNING encode(key_hash, 'hex') AS kh \gset
UPDATE idempotency_keys SET state = 'completed', response_status = 201, response_headers = '[]', response_body = '\x00', completed_at = now(), lease_expires_at = NULL WHERE tenant = 'pgbench' AND key_hash = decode(:kh, 'hex');
