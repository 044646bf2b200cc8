ALTER TABLE IF EXISTS idem_records_steps DROP COLUMN IF EXISTS fingerprint;
