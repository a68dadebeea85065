-- Duplicates are the cheap case: a claim first reads the key's record as
-- last committed, without a lock, and when that record refuses the claim
-- (completed and alive; in flight under a live lease, or held past it; its
-- outcome unknown; another fingerprint on a lease that ended) answers with
-- it at once. Before, every claim went through the upsert, which locks the
-- row even when it changes nothing: a duplicate waited on its holder's
-- transaction, wrote its lock to the WAL and made its transaction's commit
-- a flush, so a storm of retries of completed or running keys cost as much
-- as new keys.
--
-- The answer is the one the upsert would give at that moment (the
-- condition is its WHERE, negated); a record that a transaction not yet
-- committed is changing is read as it was, which is the order in which the
-- two ran. A record that would take the claim, or no record, goes on to the
-- upsert as before.

-- See 20261204000001_outcome_unknown.sql: a distributed function changes in
-- a transaction that reached every node over one connection.
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';

CREATE OR REPLACE FUNCTION idemgate_reserve(
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
    -- A record that refuses the claim, as last committed: answered without
    -- a lock (the upsert below would lock it, write that lock to the WAL,
    -- and make its transaction's commit a flush, to change nothing).
    RETURN QUERY
    SELECT false, v_now, k.tenant, k.key_hash, k.fingerprint, k.state, k.reservation_id,
           k.lease_expires_at, k.attempt, k.recovery_point, k.recovery_data, k.response_status,
           k.response_headers, k.response_body, k.created_at, k.completed_at, k.expires_at,
           k.on_lease_expiry, k.resolved_action, k.resolved_reason, k.resolved_by,
           k.resolved_at
      FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.key_hash = p_key_hash
       AND NOT (k.expires_at <= v_now
                OR (k.state = 'in_flight' AND k.lease_expires_at <= v_now
                    AND k.on_lease_expiry = 'takeover'
                    AND (k.fingerprint IS NULL OR p_fingerprint IS NULL
                         OR k.fingerprint = p_fingerprint)));
    IF FOUND THEN
        RETURN;
    END IF;
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
