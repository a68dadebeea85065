-- Why a holder marked its key unknown (SPEC §5 `POST /v1/reservations/{id}/unknown`,
-- and the layer's call whose outcome cannot be known), kept with the record
-- for the operator who settles it (§11, §13).
--
--   * unknown_reason: the holder's words (never a body).
--   * unknown_at: when, by the database's clock.
--   * unknown_reservation_id: the holder that marked it. The mark belongs
--     to that holder's record only: once another reservation holds the key
--     (the key expired or was released and reserved afresh), the columns
--     are stale and read as no mark. So neither claim function changes.
--
-- On Citus each change of the table is its own statement inside one DO
-- block, as in 20261204000001_outcome_unknown.sql, and reaches every shard.
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';

DO $migration$
BEGIN
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN unknown_reason text';
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN unknown_at timestamptz';
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN unknown_reservation_id uuid';
END
$migration$;
