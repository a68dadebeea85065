-- Why a holder marked its key unknown, when, and which holder: the
-- PostgreSQL twin of this version says what each column means. New
-- nullable columns need no rebuild of the table.

ALTER TABLE idempotency_keys ADD COLUMN unknown_reason TEXT;
ALTER TABLE idempotency_keys ADD COLUMN unknown_at INTEGER;
ALTER TABLE idempotency_keys ADD COLUMN unknown_reservation_id TEXT;
