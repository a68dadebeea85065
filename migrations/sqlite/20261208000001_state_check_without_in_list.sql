-- The state's CHECK as comparisons, not an IN list: SQLite evaluates an IN
-- list of three or more values by building a temporary b-tree of them, on
-- every statement that writes a row (every claim and commit). Comparisons
-- check the same thing without it. SQLite cannot change a CHECK in place, so
-- the table is rebuilt with the same columns, rows, indexes and trigger as
-- 20261204000001_outcome_unknown.sql, 20261206000001_marked_unknown.sql and
-- 20261207000001_one_table.sql left them (a one-time copy of every row).

CREATE TABLE idempotency_keys_next (
    tenant                  TEXT    NOT NULL,
    key_hash                BLOB    NOT NULL,
    fingerprint             TEXT,
    state                   TEXT    NOT NULL
        CHECK (state = 'in_flight' OR state = 'completed' OR state = 'unknown'),
    reservation_id          TEXT    NOT NULL
        CHECK (length(reservation_id) = 36 AND reservation_id = lower(reservation_id)),
    lease_expires_at        INTEGER,
    attempt                 INTEGER NOT NULL,
    recovery_point          TEXT,
    recovery_data           TEXT,
    response_status         INTEGER,
    response_headers        TEXT,
    response_body           BLOB,
    created_at              INTEGER NOT NULL,
    completed_at            INTEGER,
    expires_at              INTEGER NOT NULL,
    on_lease_expiry         TEXT    NOT NULL DEFAULT 'takeover'
        CHECK (on_lease_expiry = 'takeover' OR on_lease_expiry = 'hold'),
    resolved_action         TEXT
        CHECK (resolved_action = 'release' OR resolved_action = 'complete'),
    resolved_reason         TEXT,
    resolved_by             TEXT,
    resolved_at             INTEGER,
    unknown_reason          TEXT,
    unknown_at              INTEGER,
    unknown_reservation_id  TEXT,
    PRIMARY KEY (tenant, key_hash)
) STRICT;

INSERT INTO idempotency_keys_next
    (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
     recovery_point, recovery_data, response_status, response_headers, response_body,
     created_at, completed_at, expires_at, on_lease_expiry, resolved_action, resolved_reason,
     resolved_by, resolved_at, unknown_reason, unknown_at, unknown_reservation_id)
SELECT tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
       recovery_point, recovery_data, response_status, response_headers, response_body,
       created_at, completed_at, expires_at, on_lease_expiry, resolved_action, resolved_reason,
       resolved_by, resolved_at, unknown_reason, unknown_at, unknown_reservation_id
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
CREATE UNIQUE INDEX idempotency_keys_reservation ON idempotency_keys (reservation_id, tenant);

CREATE TRIGGER idempotency_keys_superseded
AFTER UPDATE OF reservation_id ON idempotency_keys
WHEN NEW.reservation_id IS NOT OLD.reservation_id
BEGIN
    INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
    SELECT OLD.tenant, OLD.reservation_id, OLD.key_hash
     WHERE NOT EXISTS (SELECT 1 FROM idempotency_reservations
                        WHERE tenant = OLD.tenant AND reservation_id = OLD.reservation_id);
END;
