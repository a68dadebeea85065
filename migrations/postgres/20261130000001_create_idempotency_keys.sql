-- One row per (tenant, key): the idempotency record of SPEC §2.
-- Tenant-first keys so that a distributed PostgreSQL (Citus, distributed by
-- `tenant`) can hold the schema unchanged.
CREATE TABLE idempotency_keys (
    tenant            text        NOT NULL,
    key_hash          bytea       NOT NULL,        -- SHA-256 of the raw key; the key itself is never stored
    fingerprint       text,                        -- NULL: the caller sent none, no mismatch can be detected
    state             text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
    reservation_id    uuid        NOT NULL,        -- fencing token of the current holder
    lease_expires_at  timestamptz,                 -- NULL once completed
    attempt           integer     NOT NULL,
    recovery_point    text,
    recovery_data     jsonb,
    response_status   integer,
    response_headers  jsonb,
    response_body     bytea,
    created_at        timestamptz NOT NULL,
    completed_at      timestamptz,
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (tenant, key_hash)
);

-- The pruning job walks this index in small batches.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- Every reservation id ever handed out for a live row, so that a dead id (taken
-- over, released, expired) answers `409 lease-lost` rather than `404 not-found`,
-- and so that commits find their row by (tenant, reservation_id).
CREATE TABLE idempotency_reservations (
    tenant          text  NOT NULL,
    reservation_id  uuid  NOT NULL,
    key_hash        bytea NOT NULL,
    PRIMARY KEY (tenant, reservation_id)
);

-- Pruning removes a key's reservations with the key.
CREATE INDEX idempotency_reservations_key ON idempotency_reservations (tenant, key_hash);
