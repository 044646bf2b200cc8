-- idem records: one row per (scope, key). Times are integer Unix nanoseconds.
-- {{table}} is the quoted table name (Config.Table), {{name}} the bare one.
CREATE TABLE IF NOT EXISTS {{table}} (
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
);

CREATE INDEX IF NOT EXISTS "{{name}}_expires_at_idx" ON {{table}} (expires_at);
