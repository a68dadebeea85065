-- Group commit: the claims, commits and releases that queued while the
-- store's previous batch was being written, applied in the order given, in
-- the caller's one transaction: one round trip and one WAL flush for all of
-- them, where one by one each took its own.
--
-- Each write is one statement of its own, so each sees what the writes before
-- it did (a second claim of a key the batch just claimed finds it in flight),
-- and each takes a fresh snapshot, as it would alone. The answer of write i
-- is the row with ord = i; a write that applied to nothing has no row.
--
--   'claim'    idemgate_reserve with the item's arguments;
--   'complete' stores the response, while the reservation holds the key;
--   'release'  expires the key at once, while the reservation holds it.
--
-- p_tenant is every item's tenant on a Citus cluster, where the function is
-- distributed by it (as idemgate_reserve is) and runs on the node that holds
-- the tenant's shard; the caller splits a batch by tenant there. On one
-- PostgreSQL it is only the first item's tenant, and the items may be any
-- tenants'.
CREATE OR REPLACE FUNCTION idemgate_write_batch(
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
    p_bodies          bytea[])
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
    expires_at       timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    w     record;
BEGIN
    -- unnest reads each array once; subscripts would walk the variable-length
    -- ones from the start for every item.
    FOR w IN
        SELECT * FROM unnest(p_ops, p_tenants, p_key_hashes, p_fingerprints, p_reservation_ids,
                             p_lease_seconds, p_ttl_seconds, p_max_in_flight, p_statuses,
                             p_headers, p_bodies)
                      WITH ORDINALITY
                      AS u(op, tenant, key_hash, fingerprint, reservation_id, lease_seconds,
                           ttl_seconds, max_in_flight, status, headers, body, i)
    LOOP
        IF w.op = 'claim' THEN
            RETURN QUERY
            SELECT w.i::integer, r.*
              FROM idemgate_reserve(w.tenant, w.key_hash, w.fingerprint, w.reservation_id,
                                    w.lease_seconds, w.ttl_seconds, w.max_in_flight) r;
        ELSIF w.op = 'complete' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET state = 'completed', response_status = w.status,
                   response_headers = w.headers, response_body = w.body, completed_at = v_now,
                   lease_expires_at = NULL
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
               AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                                  WHERE r.tenant = w.tenant
                                    AND r.reservation_id = w.reservation_id)
               AND k.state = 'in_flight' AND k.expires_at > v_now
            RETURNING w.i::integer, true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status, k.response_headers, k.response_body,
                      k.created_at, k.completed_at, k.expires_at;
        ELSIF w.op = 'release' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET expires_at = v_now, lease_expires_at = v_now
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
               AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                                  WHERE r.tenant = w.tenant
                                    AND r.reservation_id = w.reservation_id)
               AND k.state = 'in_flight' AND k.expires_at > v_now
            RETURNING w.i::integer, true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status, k.response_headers, k.response_body,
                      k.created_at, k.completed_at, k.expires_at;
        ELSE
            RAISE EXCEPTION 'idemgate_write_batch: unknown write %', w.op;
        END IF;
    END LOOP;
END
$fn$;
