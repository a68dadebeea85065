-- Windows in which some process names records in a way the others must look
-- for too: the PostgreSQL twin of this version says why. `until` in
-- milliseconds since the epoch, as every time here.
CREATE TABLE IF NOT EXISTS idemgate_windows (
    name  TEXT PRIMARY KEY,
    until INTEGER NOT NULL
);
