-- What a key was for: the request that claimed it (its method, path and
-- trace id), as JSON or sealed at rest. The PostgreSQL twin of this version
-- says more. A new nullable column needs no rebuild of the table, and a
-- file with it still opens under the previous release, whose statements
-- name their columns.

ALTER TABLE idempotency_keys ADD COLUMN request BLOB;
