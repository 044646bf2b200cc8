ALTER TABLE {{steps}} DROP COLUMN `fingerprint`
