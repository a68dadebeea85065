-- write_batch8.sql in the shape IDEMGATE_PG_POOLER=transaction sends it (see
-- reserve_one_pooled.sql): run with -M extended; claims/s = 8 x tps.
BEGIN;
SET LOCAL statement_timeout = 5000;
SELECT count(*) FROM idemgate_write_batch('pgb', array_fill('claim'::text, ARRAY[8]), array_fill('pgb'::text, ARRAY[8]), ARRAY(SELECT sha256(gen_random_uuid()::text::bytea) FROM generate_series(1,8)), array_fill('fp'::text, ARRAY[8]), ARRAY(SELECT gen_random_uuid() FROM generate_series(1,8)), array_fill(30::float8, ARRAY[8]), array_fill(3600::float8, ARRAY[8]), array_fill(NULL::int8, ARRAY[8]), array_fill(NULL::int4, ARRAY[8]), array_fill(NULL::jsonb, ARRAY[8]), array_fill(NULL::bytea, ARRAY[8]), array_fill('takeover'::text, ARRAY[8]));
COMMIT;
