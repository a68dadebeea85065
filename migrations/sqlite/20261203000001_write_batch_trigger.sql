-- Group commit: a claim writes its reservation id's row itself. A trigger
-- inserts it whenever a record gets a new holder (a new key, or an expired
-- or lease-ended record claimed again by the upsert), so the claim is one
-- statement instead of two. On this store every statement is a round trip
-- to the connection's own thread; a batch of claims saves one per claim.
-- PostgreSQL's version of this step is idemgate_write_batch, whose claims
-- run idemgate_reserve, which writes the same row.
CREATE TRIGGER idempotency_keys_new_holder_on_insert
AFTER INSERT ON idempotency_keys
BEGIN
    INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
    VALUES (NEW.tenant, NEW.reservation_id, NEW.key_hash);
END;

CREATE TRIGGER idempotency_keys_new_holder_on_update
AFTER UPDATE OF reservation_id ON idempotency_keys
WHEN NEW.reservation_id IS NOT OLD.reservation_id
BEGIN
    INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
    VALUES (NEW.tenant, NEW.reservation_id, NEW.key_hash);
END;
