-- The records table clustered on (scope, key): WITHOUT ROWID, and no expires_at
-- index. A first-time request then writes its record into one B-tree instead of
-- three (the rowid table, the primary key index and the expires_at index); the
-- janitor finds expired records by a bounded scan of the primary key, outside
-- the write lock (see DeleteExpired). Every record is copied as it is.
CREATE TABLE "{{name}}_v2" (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    state        INTEGER NOT NULL CHECK (state IN (1, 2)), -- 1 in flight, 2 complete
    fingerprint  TEXT    NOT NULL,
    token        TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    lease_until  INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    status       INTEGER,                                   -- NULL while in flight
    headers      TEXT,                                      -- JSON object of string arrays, NULL when none
    body         BLOB,
    body_omitted INTEGER NOT NULL DEFAULT 0 CHECK (body_omitted IN (0, 1)),
    ref          TEXT,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

INSERT INTO "{{name}}_v2" (scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref)
SELECT scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref FROM {{table}};

DROP INDEX IF EXISTS "{{name}}_expires_at_idx";
DROP TABLE {{table}};
ALTER TABLE "{{name}}_v2" RENAME TO {{table}};
