-- Back to the rowid table of 001, with its expires_at index.
CREATE TABLE "{{name}}_v1" (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    state        INTEGER NOT NULL CHECK (state IN (1, 2)),
    fingerprint  TEXT    NOT NULL,
    token        TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    lease_until  INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    status       INTEGER,
    headers      TEXT,
    body         BLOB,
    body_omitted INTEGER NOT NULL DEFAULT 0 CHECK (body_omitted IN (0, 1)),
    ref          TEXT,
    PRIMARY KEY (scope, key)
);

INSERT INTO "{{name}}_v1" (scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref)
SELECT scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref FROM {{table}};

DROP TABLE {{table}};
ALTER TABLE "{{name}}_v1" RENAME TO {{table}};
CREATE INDEX IF NOT EXISTS "{{name}}_expires_at_idx" ON {{table}} (expires_at);
