-- pgstore schema, version 3: each step record keeps the fingerprint of the
-- request that wrote it, so that a key released and reused for a different
-- request does not get the first request's steps. '' for the rows written
-- before (not told apart). Idempotent, as every migration.
ALTER TABLE idem_records_steps ADD COLUMN IF NOT EXISTS fingerprint bytea NOT NULL DEFAULT ''::bytea;
