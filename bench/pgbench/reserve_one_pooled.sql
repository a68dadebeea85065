-- reserve_one.sql in the shape IDEMGATE_PG_POOLER=transaction sends it: its
-- own transaction carrying the statement timeout, the claim unnamed (run with
-- -M extended: parsed and planned each time). Four round trips where
-- reserve_one.sql under -M prepared is one; idemgate's unnamed statement
-- costs one more (a Parse/Describe before the Bind/Execute) that pgbench does
-- not send, and its BEGIN and SET LOCALs are one round trip where these are two.
BEGIN;
SET LOCAL statement_timeout = 5000;
SELECT claimed FROM idemgate_reserve('pgb', sha256(gen_random_uuid()::text::bytea), 'fp', gen_random_uuid(), 30, 3600, NULL, 'takeover');
COMMIT;
