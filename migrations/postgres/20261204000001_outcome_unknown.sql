-- Unknown outcomes (SPEC §2) and operators' settlements (§11).
--
--   * state 'unknown': the holder could not tell whether its effect happened
--     (the upstream connection broke after the request went out, the
--     abandon bound passed). Every request with the key is refused until its
--     holder's late commit or release, or an operator, settles it.
--   * on_lease_expiry: what a lease that ends without news means, chosen by
--     the holder when it reserves: 'takeover' (the next request takes the key
--     over, as before) or 'hold' (the outcome is unknown; never run again by
--     itself). Existing records keep their meaning: 'takeover'.
--   * resolved_*: who settled a stuck key, when, how and why.
--
-- The claim and the batch functions gain the holder's choice as their last
-- argument and return the new columns; their old signatures are dropped, so
-- a process of the previous version answers 503 until it is replaced.
-- On Citus the ALTERs reach every shard, and the new signatures are
-- distributed after the migrations (`PgStore::migrate`).

-- On a Citus cluster, the distributed functions below may only be changed in
-- a transaction that reached every node over one connection; on a plain
-- PostgreSQL this sets a placeholder that nothing reads.
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';

-- Each change of the table is its own statement inside one DO block: on a
-- Citus cluster, ALTER TABLE and CREATE INDEX of a distributed table are
-- sent to every shard with the text they were given, and a migration's text
-- holds many statements, which a worker refuses ("cannot insert multiple
-- commands into a prepared statement").
DO $migration$
BEGIN
    EXECUTE 'ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_state_check';
    EXECUTE $$ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_state_check
                  CHECK (state IN ('in_flight', 'completed', 'unknown'))$$;
    EXECUTE $$ALTER TABLE idempotency_keys
                  ADD COLUMN on_lease_expiry text NOT NULL DEFAULT 'takeover'
                  CONSTRAINT idempotency_keys_on_lease_expiry_check
                  CHECK (on_lease_expiry IN ('takeover', 'hold'))$$;
    EXECUTE $$ALTER TABLE idempotency_keys
                  ADD COLUMN resolved_action text
                  CONSTRAINT idempotency_keys_resolved_action_check
                  CHECK (resolved_action IN ('release', 'complete'))$$;
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN resolved_reason text';
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN resolved_by text';
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN resolved_at timestamptz';
    -- The keys marked unknown, for the operators' listing and the
    -- idemgate_keys_unknown gauge (the keys held past their lease are found
    -- through idempotency_keys_in_flight). Few rows: only unknown ones.
    EXECUTE $$CREATE INDEX IF NOT EXISTS idempotency_keys_unknown
                  ON idempotency_keys (created_at) WHERE state = 'unknown'$$;
END
$migration$;

DROP FUNCTION IF EXISTS idemgate_write_batch(text, text[], text[], bytea[], text[], uuid[],
                                             float8[], float8[], int8[], int4[], jsonb[], bytea[]);
DROP FUNCTION IF EXISTS idemgate_reserve(text, bytea, text, uuid, float8, float8, int8);

-- As in 20261202000001_reserve_function.sql, with the holder's choice: an
-- in-flight record whose lease ended is taken over only when its holder
-- chose 'takeover'; one held past its lease is read as it stands (the
-- engine answers 409 outcome-unknown). A claim writes the new holder's
-- choice, and clears an expired record's settlement.
CREATE FUNCTION idemgate_reserve(
    p_tenant          text,
    p_key_hash        bytea,
    p_fingerprint     text,
    p_reservation_id  uuid,
    p_lease_seconds   float8,
    p_ttl_seconds     float8,
    p_max_in_flight   int8,
    p_on_lease_expiry text)
RETURNS TABLE (
    claimed          boolean,
    db_now           timestamptz,
    tenant           text,
    key_hash         bytea,
    fingerprint      text,
    state            text,
    reservation_id   uuid,
    lease_expires_at timestamptz,
    attempt          integer,
    recovery_point   text,
    recovery_data    jsonb,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz,
    completed_at     timestamptz,
    expires_at       timestamptz,
    on_lease_expiry  text,
    resolved_action  text,
    resolved_reason  text,
    resolved_by      text,
    resolved_at      timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := now();
    v_live int8;
BEGIN
    IF p_max_in_flight IS NOT NULL THEN
        SELECT count(*) INTO v_live FROM (
            SELECT 1 FROM idempotency_keys c
             WHERE c.tenant = p_tenant AND c.state = 'in_flight'
               AND c.lease_expires_at > v_now AND c.expires_at > v_now
             LIMIT p_max_in_flight) live;
    END IF;
    IF p_max_in_flight IS NULL OR v_live < p_max_in_flight THEN
        RETURN QUERY
        INSERT INTO idempotency_keys AS k
            (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
             created_at, expires_at, on_lease_expiry)
        VALUES (p_tenant, p_key_hash, p_fingerprint, 'in_flight', p_reservation_id,
                v_now + make_interval(secs => p_lease_seconds), 1, v_now,
                v_now + make_interval(secs => p_ttl_seconds), p_on_lease_expiry)
        ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO UPDATE SET
            fingerprint = CASE WHEN k.expires_at <= v_now THEN EXCLUDED.fingerprint
                               ELSE COALESCE(k.fingerprint, EXCLUDED.fingerprint) END,
            state = 'in_flight',
            reservation_id = EXCLUDED.reservation_id,
            lease_expires_at = EXCLUDED.lease_expires_at,
            attempt = CASE WHEN k.expires_at <= v_now THEN 1 ELSE k.attempt + 1 END,
            recovery_point = CASE WHEN k.expires_at <= v_now THEN NULL ELSE k.recovery_point END,
            recovery_data = CASE WHEN k.expires_at <= v_now THEN NULL ELSE k.recovery_data END,
            response_status = NULL,
            response_headers = NULL,
            response_body = NULL,
            created_at = CASE WHEN k.expires_at <= v_now THEN v_now ELSE k.created_at END,
            completed_at = NULL,
            expires_at = CASE WHEN k.expires_at <= v_now THEN EXCLUDED.expires_at
                              ELSE k.expires_at END,
            on_lease_expiry = EXCLUDED.on_lease_expiry,
            resolved_action = NULL,
            resolved_reason = NULL,
            resolved_by = NULL,
            resolved_at = NULL
        WHERE k.expires_at <= v_now
           OR (k.state = 'in_flight' AND k.lease_expires_at <= v_now
               AND k.on_lease_expiry = 'takeover'
               AND (k.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL
                    OR k.fingerprint = EXCLUDED.fingerprint))
        RETURNING true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state, k.reservation_id,
                  k.lease_expires_at, k.attempt, k.recovery_point, k.recovery_data,
                  k.response_status, k.response_headers, k.response_body, k.created_at,
                  k.completed_at, k.expires_at, k.on_lease_expiry, k.resolved_action,
                  k.resolved_reason, k.resolved_by, k.resolved_at;
        IF FOUND THEN
            INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
            VALUES (p_tenant, p_reservation_id, p_key_hash);
            RETURN;
        END IF;
    END IF;
    -- A statement of its own, so a fresh snapshot: it sees the record that a
    -- concurrent claim committed while the insert above waited on its lock.
    RETURN QUERY
    SELECT false, v_now, k.tenant, k.key_hash, k.fingerprint, k.state, k.reservation_id,
           k.lease_expires_at, k.attempt, k.recovery_point, k.recovery_data, k.response_status,
           k.response_headers, k.response_body, k.created_at, k.completed_at, k.expires_at,
           k.on_lease_expiry, k.resolved_action, k.resolved_reason, k.resolved_by,
           k.resolved_at
      FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.key_hash = p_key_hash;
END
$fn$;

-- As in 20261203000001_write_batch_function.sql, with each claim's choice
-- (p_on_lease_expiry), and commits and releases that settle a key its
-- holder marked unknown (its reservation id is still the current one).
CREATE FUNCTION idemgate_write_batch(
    p_tenant          text,
    p_ops             text[],
    p_tenants         text[],
    p_key_hashes      bytea[],
    p_fingerprints    text[],
    p_reservation_ids uuid[],
    p_lease_seconds   float8[],
    p_ttl_seconds     float8[],
    p_max_in_flight   int8[],
    p_statuses        int4[],
    p_headers         jsonb[],
    p_bodies          bytea[],
    p_on_lease_expiry text[])
RETURNS TABLE (
    ord              integer,
    claimed          boolean,
    db_now           timestamptz,
    tenant           text,
    key_hash         bytea,
    fingerprint      text,
    state            text,
    reservation_id   uuid,
    lease_expires_at timestamptz,
    attempt          integer,
    recovery_point   text,
    recovery_data    jsonb,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz,
    completed_at     timestamptz,
    expires_at       timestamptz,
    on_lease_expiry  text,
    resolved_action  text,
    resolved_reason  text,
    resolved_by      text,
    resolved_at      timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    w     record;
BEGIN
    FOR w IN
        SELECT * FROM unnest(p_ops, p_tenants, p_key_hashes, p_fingerprints, p_reservation_ids,
                             p_lease_seconds, p_ttl_seconds, p_max_in_flight, p_statuses,
                             p_headers, p_bodies, p_on_lease_expiry)
                      WITH ORDINALITY
                      AS u(op, tenant, key_hash, fingerprint, reservation_id, lease_seconds,
                           ttl_seconds, max_in_flight, status, headers, body, on_lease_expiry, i)
    LOOP
        IF w.op = 'claim' THEN
            RETURN QUERY
            SELECT w.i::integer, r.*
              FROM idemgate_reserve(w.tenant, w.key_hash, w.fingerprint, w.reservation_id,
                                    w.lease_seconds, w.ttl_seconds, w.max_in_flight,
                                    w.on_lease_expiry) r;
        ELSIF w.op = 'complete' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET state = 'completed', response_status = w.status,
                   response_headers = w.headers, response_body = w.body, completed_at = v_now,
                   lease_expires_at = NULL
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
               AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                                  WHERE r.tenant = w.tenant
                                    AND r.reservation_id = w.reservation_id)
               AND k.state IN ('in_flight', 'unknown') AND k.expires_at > v_now
            RETURNING w.i::integer, true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status, k.response_headers, k.response_body,
                      k.created_at, k.completed_at, k.expires_at, k.on_lease_expiry,
                      k.resolved_action, k.resolved_reason, k.resolved_by, k.resolved_at;
        ELSIF w.op = 'release' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET expires_at = v_now, lease_expires_at = v_now
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
               AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                                  WHERE r.tenant = w.tenant
                                    AND r.reservation_id = w.reservation_id)
               AND k.state IN ('in_flight', 'unknown') AND k.expires_at > v_now
            RETURNING w.i::integer, true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status, k.response_headers, k.response_body,
                      k.created_at, k.completed_at, k.expires_at, k.on_lease_expiry,
                      k.resolved_action, k.resolved_reason, k.resolved_by, k.resolved_at;
        ELSE
            RAISE EXCEPTION 'idemgate_write_batch: unknown write %', w.op;
        END IF;
    END LOOP;
END
$fn$;
