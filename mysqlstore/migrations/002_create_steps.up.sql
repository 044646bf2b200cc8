-- Step records (idem.Step): one row per (scope, key, name) of a request record,
-- written on the store's own connections, outside any business transaction.
-- {{steps}} is replaced by the records table's name with "_steps", quoted.
-- Times are Unix microseconds, as in the records table.
CREATE TABLE IF NOT EXISTS {{steps}} (
  `scope`       VARBINARY(255)   NOT NULL,
  `key`         VARBINARY(255)   NOT NULL,
  `name`        VARBINARY(100)   NOT NULL,
  `state`       TINYINT UNSIGNED NOT NULL,
  `owner`       VARBINARY(255)   NOT NULL,
  `derived_key` VARBINARY(255)   NOT NULL,
  `result`      LONGBLOB         NULL,
  `started_at`  BIGINT           NOT NULL,
  `expires_at`  BIGINT           NOT NULL,
  `attempt`     VARBINARY(32)    NOT NULL,
  `seq`         BIGINT UNSIGNED  NOT NULL DEFAULT 0,
  PRIMARY KEY (`scope`, `key`, `name`),
  KEY `expires_at_idx` (`expires_at`)
) ENGINE=InnoDB
