-- idem records. {{table}} is replaced by the configured table name, quoted.
-- scope and key are VARBINARY: byte-exact, case-sensitive comparisons whatever the
-- server's default collation; 255 + 255 bytes keep the primary key far below
-- InnoDB's 3072-byte index limit. Times are Unix microseconds (BIGINT), so no DSN
-- option (parseTime, loc) and no server time zone can change them.
CREATE TABLE IF NOT EXISTS {{table}} (
  `scope`        VARBINARY(255)    NOT NULL,
  `key`          VARBINARY(255)    NOT NULL,
  `state`        TINYINT UNSIGNED  NOT NULL,
  `fingerprint`  VARBINARY(512)    NOT NULL,
  `token`        VARBINARY(255)    NOT NULL,
  `created_at`   BIGINT            NOT NULL,
  `lease_until`  BIGINT            NOT NULL,
  `expires_at`   BIGINT            NOT NULL,
  `renewals`     BIGINT UNSIGNED   NOT NULL DEFAULT 0,
  `status`       SMALLINT UNSIGNED NULL,
  `headers`      MEDIUMBLOB        NULL,
  `body`         LONGBLOB          NULL,
  `body_omitted` TINYINT(1)        NOT NULL DEFAULT 0,
  `ref`          BLOB              NULL,
  PRIMARY KEY (`scope`, `key`),
  KEY `expires_at_idx` (`expires_at`)
) ENGINE=InnoDB
