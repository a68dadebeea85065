-- A new key writes one row, its record: the PostgreSQL twin of this version
-- says why. Here:
--
--   * idempotency_keys_reservation: the record by its reservation id (and
--     tenant), for a holder's statements and lookups; the id first, as on
--     PostgreSQL.
--   * The trigger that wrote every new record's id into
--     idempotency_reservations goes. That table keeps only superseded ids,
--     written by the trigger on a change of a record's id (a takeover, or a
--     claim of an expired or released key), which now writes the id being
--     replaced, unless it is there already: an older version wrote every id
--     there, the one being replaced included, and those rows stay valid. (Not
--     INSERT OR IGNORE: the claim's own ON CONFLICT clause would override
--     it.)

CREATE UNIQUE INDEX idempotency_keys_reservation ON idempotency_keys (reservation_id, tenant);

DROP TRIGGER idempotency_keys_new_holder_on_insert;
DROP TRIGGER idempotency_keys_new_holder_on_update;

CREATE TRIGGER idempotency_keys_superseded
AFTER UPDATE OF reservation_id ON idempotency_keys
WHEN NEW.reservation_id IS NOT OLD.reservation_id
BEGIN
    INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
    SELECT OLD.tenant, OLD.reservation_id, OLD.key_hash
     WHERE NOT EXISTS (SELECT 1 FROM idempotency_reservations
                        WHERE tenant = OLD.tenant AND reservation_id = OLD.reservation_id);
END;
