-- Each step record keeps the fingerprint of the request that wrote it, so that
-- a key released and reused for a different request does not get the first
-- request's steps. '' for the rows written before (not told apart). MySQL has
-- no ADD COLUMN IF NOT EXISTS: Migrate goes on past "duplicate column" (1060)
-- when it re-runs this after a crash half-way; so must another tool.
ALTER TABLE {{steps}} ADD COLUMN `fingerprint` VARBINARY(512) NOT NULL DEFAULT ''
