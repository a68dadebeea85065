-- Unknown outcomes and operators' settlements: the PostgreSQL twin of this
-- version says what each column means. SQLite cannot change a CHECK
-- constraint in place, so the table is rebuilt with the new one and the new
-- columns (existing records keep their meaning: 'takeover', never resolved),
-- and its indexes and triggers are made again.

CREATE TABLE idempotency_keys_next (
    tenant            TEXT    NOT NULL,
    key_hash          BLOB    NOT NULL,
    fingerprint       TEXT,
    state             TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    reservation_id    TEXT    NOT NULL CHECK (length(reservation_id) = 36 AND reservation_id = lower(reservation_id)),
    lease_expires_at  INTEGER,
    attempt           INTEGER NOT NULL,
    recovery_point    TEXT,
    recovery_data     TEXT,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    created_at        INTEGER NOT NULL,
    completed_at      INTEGER,
    expires_at        INTEGER NOT NULL,
    on_lease_expiry   TEXT    NOT NULL DEFAULT 'takeover' CHECK (on_lease_expiry IN ('takeover', 'hold')),
    resolved_action   TEXT    CHECK (resolved_action IN ('release', 'complete')),
    resolved_reason   TEXT,
    resolved_by       TEXT,
    resolved_at       INTEGER,
    PRIMARY KEY (tenant, key_hash)
) STRICT;

INSERT INTO idempotency_keys_next
    (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
     recovery_point, recovery_data, response_status, response_headers, response_body,
     created_at, completed_at, expires_at)
SELECT tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
       recovery_point, recovery_data, response_status, response_headers, response_body,
       created_at, completed_at, expires_at
  FROM idempotency_keys;

DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_next RENAME TO idempotency_keys;

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
CREATE INDEX idempotency_keys_in_flight
    ON idempotency_keys (tenant, lease_expires_at)
    WHERE state = 'in_flight';
CREATE INDEX idempotency_keys_unknown
    ON idempotency_keys (created_at)
    WHERE state = 'unknown';

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
