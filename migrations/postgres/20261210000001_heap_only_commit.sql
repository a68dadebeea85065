-- A commit that leaves every index alone: a heap-only (HOT) update.
--
-- A commit changes `state`, the response's columns and `completed_at`.
-- PostgreSQL writes an update in place of the row's page, with no new
-- index entry, only when no column that an index reads (its keys, its
-- expressions, its predicate) changes, and the page has room. Until now two
-- partial indexes read `state` (idempotency_keys_in_flight and
-- idempotency_keys_unknown) and the commit cleared `lease_expires_at`, which
-- the first indexes, so every commit wrote a new entry into each of the
-- table's five indexes.
--
--   * The commit keeps the lease's end (a completed record's lease means
--     nothing: the store reads it as none) and no index reads `state`.
--   * idempotency_keys_lease_end (lease_expires_at): the keys whose lease
--     ended since the last count, read from where that count stopped, so the
--     count of stuck keys (the idemgate_keys_unknown gauge) is kept by each
--     process, never by reading every alive key (src/store/postgres/stuck.rs).
--   * idempotency_keys_marked_unknown (unknown_at, where one is set): the
--     keys a holder marked unknown, whatever their lease. A mark changes the
--     row anyway; a commit does not touch the column.
--   * `limited`: true on a row claimed under a tenant limit
--     (IDEMGATE_TENANT_MAX_IN_FLIGHT) until its commit or release; the
--     limit's count reads idempotency_keys_limited, which holds only those
--     rows. A commit of a key without a limit writes false over false, which
--     is no change: it stays heap-only. Rows in flight now are marked, so no
--     live key escapes the count (a superset: the count checks each row).
--   * fillfactor 85: room on each page for the commit's new version of a
--     row (new pages only; existing ones fill as before).
--   * idempotency_keys_in_flight and idempotency_keys_unknown are dropped.
--
-- Three steps, none of which holds writes for long, whatever the table's
-- size (SPEC §14; docs/operations.md, "Upgrading"):
--
--   1. this one: the column and the storage parameter, then the functions
--      that write `limited`. Each ALTER is a change of the catalog only (a
--      column with a constant default is no rewrite; fillfactor takes a
--      lock that writes pass), taken with a short lock_timeout: behind a
--      transaction that holds the table, the step gives up within it rather
--      than queue every write behind itself, and `idemgate migrate` runs it
--      again (src/store/postgres/migrate.rs).
--   2. 20261210000002_limited_in_flight.sql: the rows in flight marked
--      `limited`, after the functions mark every new claim.
--   3. 20261210000003_heap_only_commit_indexes.sql: the indexes built and
--      dropped CONCURRENTLY, outside a transaction. Until then the limit's
--      count reads idempotency_keys_in_flight, as before.
--
-- An expand step: the previous release serves the database beside this one,
-- before and after it (and after a rollback). Its statements name no index,
-- and its claims and batches run the functions below. Without the two
-- dropped indexes its own counts (the stuck keys once a pruning pass, a
-- tenant's keys in flight when a claim is refused) read more rows; its
-- commits sent outside a batch clear the lease's end and, for a row with a
-- limit, leave `limited` set, which the limit's count ignores (it checks the
-- row's state) until the key is pruned.
--
-- On Citus each change is a statement of its own inside a DO block, as in
-- 20261204000001_outcome_unknown.sql, and reaches every shard; the functions
-- keep their signatures, so they stay distributed.
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';
SET LOCAL lock_timeout = '500ms';
SET LOCAL statement_timeout = '5s';

DO $migration$
BEGIN
    EXECUTE 'ALTER TABLE idempotency_keys SET (fillfactor = 85)';
    EXECUTE 'ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS limited boolean NOT NULL DEFAULT false';
END
$migration$;

-- As in 20261209000001_claimed_request.sql, with `limited` written by every
-- claim that applies, and counted by the limit.
CREATE OR REPLACE FUNCTION idemgate_reserve(
    p_tenant          text,
    p_key_hash        bytea,
    p_fingerprint     text,
    p_reservation_id  uuid,
    p_lease_seconds   float8,
    p_ttl_seconds     float8,
    p_max_in_flight   int8,
    p_on_lease_expiry text,
    p_request         bytea)
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
    v_now       timestamptz := now();
    -- Computed here: Citus refuses a function that is not immutable (as
    -- timestamptz + interval is not) inside a CASE of a distributed UPDATE.
    v_lease_end timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_expires   timestamptz := v_now + make_interval(secs => p_ttl_seconds);
    v_live      int8;
    v_old       uuid;
BEGIN
    -- A record that refuses the claim, as last committed: answered without
    -- a lock (20261205000002_claims_read_first.sql).
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
             WHERE c.tenant = p_tenant AND c.limited AND c.state = 'in_flight'
               AND c.lease_expires_at > v_now AND c.expires_at > v_now
             LIMIT p_max_in_flight) live;
    END IF;
    IF p_max_in_flight IS NULL OR v_live < p_max_in_flight THEN
        -- A new key. On a key that has a record DO NOTHING neither locks
        -- nor writes (it waits for a transaction still writing that record,
        -- as the statements below would).
        RETURN QUERY
        INSERT INTO idempotency_keys AS k
            (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
             created_at, expires_at, on_lease_expiry, request, limited)
        VALUES (p_tenant, p_key_hash, p_fingerprint, 'in_flight', p_reservation_id, v_lease_end,
                1, v_now, v_expires, p_on_lease_expiry, p_request, p_max_in_flight IS NOT NULL)
        ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
        RETURNING true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state, k.reservation_id,
                  k.lease_expires_at, k.attempt, k.recovery_point, k.recovery_data,
                  k.response_status, k.response_headers, k.response_body, k.created_at,
                  k.completed_at, k.expires_at, k.on_lease_expiry, k.resolved_action,
                  k.resolved_reason, k.resolved_by, k.resolved_at;
        IF FOUND THEN
            RETURN;
        END IF;
        -- A record is there: one that takes the claim, or one that a
        -- concurrent claim has just written. Under its row lock, the id it
        -- has now: the one this claim supersedes if it applies.
        SELECT k.reservation_id INTO v_old
          FROM idempotency_keys k
         WHERE k.tenant = p_tenant AND k.key_hash = p_key_hash
           FOR UPDATE;
        IF FOUND THEN
            -- An expired record is reset; an in-flight one whose lease ended
            -- under 'takeover' (fingerprints compatible) is taken over.
            RETURN QUERY
            UPDATE idempotency_keys k SET
                fingerprint = CASE WHEN k.expires_at <= v_now THEN p_fingerprint
                                   ELSE COALESCE(k.fingerprint, p_fingerprint) END,
                state = 'in_flight',
                reservation_id = p_reservation_id,
                lease_expires_at = v_lease_end,
                attempt = CASE WHEN k.expires_at <= v_now THEN 1 ELSE k.attempt + 1 END,
                recovery_point = CASE WHEN k.expires_at <= v_now THEN NULL
                                      ELSE k.recovery_point END,
                recovery_data = CASE WHEN k.expires_at <= v_now THEN NULL
                                     ELSE k.recovery_data END,
                response_status = NULL,
                response_headers = NULL,
                response_body = NULL,
                created_at = CASE WHEN k.expires_at <= v_now THEN v_now ELSE k.created_at END,
                completed_at = NULL,
                expires_at = CASE WHEN k.expires_at <= v_now THEN v_expires
                                  ELSE k.expires_at END,
                on_lease_expiry = p_on_lease_expiry,
                request = p_request,
                limited = p_max_in_flight IS NOT NULL,
                resolved_action = NULL,
                resolved_reason = NULL,
                resolved_by = NULL,
                resolved_at = NULL
             WHERE k.tenant = p_tenant AND k.key_hash = p_key_hash
               AND (k.expires_at <= v_now
                    OR (k.state = 'in_flight' AND k.lease_expires_at <= v_now
                        AND k.on_lease_expiry = 'takeover'
                        AND (k.fingerprint IS NULL OR p_fingerprint IS NULL
                             OR k.fingerprint = p_fingerprint)))
            RETURNING true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status, k.response_headers, k.response_body,
                      k.created_at, k.completed_at, k.expires_at, k.on_lease_expiry,
                      k.resolved_action, k.resolved_reason, k.resolved_by, k.resolved_at;
            IF FOUND THEN
                -- An older version wrote every id here: the replaced one may
                -- be here already.
                INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                VALUES (p_tenant, v_old, p_key_hash)
                ON CONFLICT DO NOTHING;
                RETURN;
            END IF;
        END IF;
    END IF;
    -- A statement of its own, so a fresh snapshot: it sees the record that a
    -- concurrent claim committed while the statements above waited on it.
    -- None: the record was pruned in between (the caller tries again), or
    -- the limit held back a key that has none.
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

-- As in 20261209000001_claimed_request.sql, with a commit that keeps the
-- lease's end and clears `limited`, and a release that clears it too.
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
    p_on_lease_expiry text[],
    p_requests        bytea[])
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
    -- Every key the batch will write, locked first, in one order. A commit
    -- or a release locks the one row that holds its id when it runs; an id
    -- is never handed out twice, so that row is the one found here, or none.
    FOR w IN
        SELECT * FROM unnest(p_tenants, p_key_hashes, p_reservation_ids)
                      AS u(tenant, key_hash, reservation_id)
    LOOP
        v_hash := w.key_hash;
        IF v_hash IS NULL THEN
            SELECT k.key_hash INTO v_hash FROM idempotency_keys k
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id;
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
                             p_headers, p_bodies, p_on_lease_expiry, p_requests)
                      WITH ORDINALITY
                      AS u(op, tenant, key_hash, fingerprint, reservation_id, lease_seconds,
                           ttl_seconds, max_in_flight, status, headers, body, on_lease_expiry,
                           request, i)
    LOOP
        IF w.op = 'claim' THEN
            RETURN QUERY
            SELECT w.i::integer, r.*
              FROM idemgate_reserve(w.tenant, w.key_hash, w.fingerprint, w.reservation_id,
                                    w.lease_seconds, w.ttl_seconds, w.max_in_flight,
                                    w.on_lease_expiry, w.request) r;
        ELSIF w.op = 'complete' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET state = 'completed', response_status = w.status,
                   response_headers = w.headers, response_body = w.body, completed_at = v_now,
                   limited = false
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
               AND k.state IN ('in_flight', 'unknown') AND k.expires_at > v_now
            -- Not the response it was just sent: the caller has it.
            RETURNING w.i::integer, true, v_now, k.tenant, k.key_hash, k.fingerprint, k.state,
                      k.reservation_id, k.lease_expires_at, k.attempt, k.recovery_point,
                      k.recovery_data, k.response_status,
                      NULL::jsonb, NULL::bytea,
                      k.created_at, k.completed_at, k.expires_at, k.on_lease_expiry,
                      k.resolved_action, k.resolved_reason, k.resolved_by, k.resolved_at;
        ELSIF w.op = 'release' THEN
            RETURN QUERY
            UPDATE idempotency_keys k SET expires_at = v_now, lease_expires_at = v_now,
                   limited = false
             WHERE k.tenant = w.tenant AND k.reservation_id = w.reservation_id
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
