-- One claim per transaction through idemgate_reserve, as a lone write sends it.
SELECT claimed FROM idemgate_reserve('pgb', sha256(gen_random_uuid()::text::bytea), 'fp', gen_random_uuid(), 30, 3600, NULL, 'takeover');
