-- No two batches wait on each other's row locks: a batch first takes a
-- transaction-scoped advisory lock for every key it will write (a claim's
-- key; a commit's or a release's, found through its reservation id without
-- a lock), all in one order, the same in every process (by a hash of the
-- tenant, then the key hash's first four bytes), and only then writes, in
-- queue order as before. Before, two batches holding the same keys in
-- opposite orders (a retry storm sending one key sequence through two
-- connections, two writers or two processes) each locked one key's row and
-- waited for the other's, until PostgreSQL's deadlock_timeout (1 s) broke
-- one of them and its writes went again one by one.
--
-- Why locks beside the rows rather than the rows in sorted order: the
-- writes keep their queue order, so each answers exactly as one by one,
-- a tenant's limit of in-flight keys included (it counts the keys the
-- writes before it claimed and released).
--
-- Why this is enough: a batch holds the advisory locks of every row it
-- will lock, so no other batch waits for a row it holds while holding one
-- it wants; every other transaction of idemgate writes one key (and so
-- holds nothing while it waits), and pruning skips locked rows. Two keys
-- whose hashes meet share a lock, which only orders them.
--
-- The two-int4 form of the advisory locks: a keyspace of its own, apart
-- from the bigint locks of the migrations.

-- See 20261204000001_outcome_unknown.sql: a distributed function changes in
-- a transaction that reached every node over one connection.
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';

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
    w        record;
    l        record;
    v_hash   bytea;
    v_spaces int4[] := '{}';
    v_keys   int4[] := '{}';
BEGIN
    -- Every key the batch will write, locked first, in one order. Statements
    -- that name their tenant by a variable, so that on Citus each runs on the
    -- tenant's shard alone (a join with the arrays would be sent to every
    -- shard).
    FOR w IN
        SELECT * FROM unnest(p_tenants, p_key_hashes, p_reservation_ids)
                      AS u(tenant, key_hash, reservation_id)
    LOOP
        v_hash := w.key_hash;
        IF v_hash IS NULL THEN
            SELECT r.key_hash INTO v_hash FROM idempotency_reservations r
             WHERE r.tenant = w.tenant AND r.reservation_id = w.reservation_id;
        END IF;
        IF v_hash IS NOT NULL THEN
            v_spaces := v_spaces || hashtext(w.tenant);
            v_keys := v_keys
                || ('x' || encode(substring(v_hash FROM 1 FOR 4), 'hex'))::bit(32)::int4;
        END IF;
    END LOOP;
    FOR l IN
        SELECT DISTINCT x.space, x.key FROM unnest(v_spaces, v_keys) AS x(space, key)
         ORDER BY 1, 2
    LOOP
        PERFORM pg_advisory_xact_lock(l.space, l.key);
    END LOOP;
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
