-- Windows in which some process names records in a way the others must look
-- for too. One today, `plain-names`: a process with IDEMGATE_SEAL_KEY and
-- IDEMGATE_SEAL_ACCEPT_PLAINTEXT (the window after sealing is turned on)
-- keeps new records under their plain SHA-256 names, so that a process
-- without the seal key, or of a release before keyed names, finds them; it
-- moves `until` to the end of the longest TTL it gives a key, on start and
-- every minute. A process that keys names looks for a new key under its
-- plain names too while `until` has not passed, and only then: after the
-- window, a new key costs one claim.
--
-- An expand step: a new table, which a previous release never reads. Small
-- (a row per window) and local on Citus (never joined with the keys).
CREATE TABLE IF NOT EXISTS idemgate_windows (
    name  text PRIMARY KEY,
    until timestamptz NOT NULL
);
