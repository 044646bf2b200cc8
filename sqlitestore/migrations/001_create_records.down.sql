DROP INDEX IF EXISTS "{{name}}_expires_at_idx";
DROP TABLE IF EXISTS {{table}};
