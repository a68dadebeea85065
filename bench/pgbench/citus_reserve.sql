-- One claim of a fresh key per transaction, through idemgate_reserve, for
-- pgbench: BENCHMARKS.md "Scaling out on Citus" compares it on one PostgreSQL,
-- through a Citus coordinator and directly on a worker. The arguments are
-- constants (md5 of the random number for the reservation id), so that Citus
-- delegates the call to the tenant's worker. In a schema other than the
-- search_path's, qualify the function.
\set k random(1, 1000000000)
SELECT claimed FROM idemgate_reserve('t' || (:k % 100), sha256((:k)::text::bytea), 'fp',
                                     md5(:k::text)::uuid, 30, 600, NULL, 'takeover');
