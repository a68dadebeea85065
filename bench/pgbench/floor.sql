-- The measured floor of a new key on PostgreSQL: the two durable writes a key
-- needs, each its own autocommitted transaction, with nothing else: the claim
-- row INSERTed into bench_floor_keys (idempotency_keys's columns, its primary
-- key and no other index), then the response stored by an UPDATE. keys/s =
-- tps. The suite (`bench/run --only floor`) creates the table and runs this as
-- pgbench -n -M prepared -c C -j 2 -T SECONDS -f floor.sql.
\set k random(1, 9000000000000000000)
INSERT INTO bench_floor_keys (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, created_at, expires_at) VALUES ('pgbench', sha256(:k::text::bytea), 'fp', 'in_flight', gen_random_uuid(), now() + interval '30 s', 1, now(), now() + interval '1 day') ON CONFLICT DO NOTHING;
UPDATE bench_floor_keys SET state = 'completed', response_status = 201, response_headers = '[["content-type","application/json"]]', response_body = '\x7b7d', completed_at = now(), lease_expires_at = NULL WHERE tenant = 'pgbench' AND key_hash = sha256(:k::text::bytea);
