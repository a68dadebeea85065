-- The embedded store's schema: the same two tables as migrations/postgres,
-- with the same names, columns and keys, in SQLite types. It carries the same
-- version number as its PostgreSQL twin, so one version means one schema on
-- both backends.
--
-- Encodings (SQLite has no timestamp, uuid or json type):
--   * timestamps: INTEGER milliseconds since the Unix epoch (UTC). Integers
--     sort and compare exactly, and the store compares them in SQL
--     (`expires_at <= now`), which text timestamps would only do by accident
--     of formatting.
--   * uuids: TEXT, lowercase hyphenated (`8e03978e-40d5-43e8-bc93-6894a57f9324`),
--     as the API prints them, so an operator can paste an id from a log into
--     `sqlite3`. The CHECK keeps every writer to that one spelling, which the
--     equality lookups rely on.
--   * JSON: TEXT holding serde_json's rendering; SQL NULL for "none", so a JSON
--     `null` stays distinguishable from an absent value, as with jsonb.
--
-- STRICT tables make SQLite enforce the declared types (no silent text in an
-- integer column).

-- One row per (tenant, key): the idempotency record of SPEC §2.
CREATE TABLE idempotency_keys (
    tenant            TEXT    NOT NULL,
    key_hash          BLOB    NOT NULL,        -- SHA-256 of the raw key; the key itself is never stored
    fingerprint       TEXT,                    -- NULL: the caller sent none, no mismatch can be detected
    state             TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    reservation_id    TEXT    NOT NULL CHECK (length(reservation_id) = 36 AND reservation_id = lower(reservation_id)),
    lease_expires_at  INTEGER,                 -- NULL once completed
    attempt           INTEGER NOT NULL,
    recovery_point    TEXT,
    recovery_data     TEXT,                    -- JSON
    response_status   INTEGER,
    response_headers  TEXT,                    -- JSON: [[name, value], ...]
    response_body     BLOB,
    created_at        INTEGER NOT NULL,
    completed_at      INTEGER,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (tenant, key_hash)
) STRICT;

-- The pruning job walks this index in small batches.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- Every reservation id ever handed out for a live row, so that a dead id (taken
-- over, released, expired) answers `409 lease-lost` rather than `404 not-found`,
-- and so that commits find their row by (tenant, reservation_id).
CREATE TABLE idempotency_reservations (
    tenant          TEXT NOT NULL,
    reservation_id  TEXT NOT NULL CHECK (length(reservation_id) = 36 AND reservation_id = lower(reservation_id)),
    key_hash        BLOB NOT NULL,
    PRIMARY KEY (tenant, reservation_id)
) STRICT;

-- Pruning removes a key's reservations with the key.
CREATE INDEX idempotency_reservations_key ON idempotency_reservations (tenant, key_hash);
