-- The claim of SPEC §2 as one function, so that it is one round trip on one
-- PostgreSQL and one router call on a Citus cluster, where the function is
-- distributed by its tenant argument, colocated with the tables, and runs on
-- the worker that holds the tenant's shard (`PgStore::migrate` distributes
-- it). On Citus a statement that inserts inside a CTE cannot be routed to one
-- shard, and an ON CONFLICT DO UPDATE may not call now(); here each statement
-- is a single-shard one and the clock is read once, into v_now.
--
-- Inserts a new record, or, under the row lock that ON CONFLICT takes, resets
-- an expired one or takes over an in-flight one whose lease ended
-- (fingerprints compatible), and then records the new reservation id. When
-- neither applies it reads the record as it stands (claimed = false).
--
-- p_max_in_flight (NULL: no limit) is the tenant's limit of live in-flight
-- keys: at or beyond it nothing is claimed, and a key with no record returns
-- no row. The count reads the statement's snapshot, so claims running at the
-- same instant can each see room: the limit can be passed by at most the
-- number of such calls (one per connection).
CREATE OR REPLACE FUNCTION idemgate_reserve(
    p_tenant         text,
    p_key_hash       bytea,
    p_fingerprint    text,
    p_reservation_id uuid,
    p_lease_seconds  float8,
    p_ttl_seconds    float8,
    p_max_in_flight  int8)
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
    expires_at       timestamptz)
LANGUAGE plpgsql
-- The schema the migration ran in, wherever the function runs (a Citus
-- worker's session has its own search_path).
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
             created_at, expires_at)
        VALUES (p_tenant, p_key_hash, p_fingerprint, 'in_flight', p_reservation_id,
                v_now + make_interval(secs => p_lease_seconds), 1, v_now,
                v_now + make_interval(secs => p_ttl_seconds))
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
                              ELSE k.expires_at END
        WHERE k.expires_at <= v_now
           OR (k.state = 'in_flight' AND k.lease_expires_at <= v_now
               AND (k.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL
                    OR k.fingerprint = EXCLUDED.fingerprint))
        RETURNING true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state, k.reservation_id,
                  k.lease_expires_at, k.attempt, k.recovery_point, k.recovery_data,
                  k.response_status, k.response_headers, k.response_body, k.created_at,
                  k.completed_at, k.expires_at;
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
           k.response_headers, k.response_body, k.created_at, k.completed_at, k.expires_at
      FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.key_hash = p_key_hash;
END
$fn$;
