-- pgstore schema, version 1. Every migration is idempotent (IF NOT EXISTS), so
-- that Store.Migrate can run them all on every start under an advisory lock.
CREATE TABLE IF NOT EXISTS idem_records (
    scope        bytea       NOT NULL,               -- tenant or principal (any bytes)
    key          bytea       NOT NULL,               -- the Idempotency-Key
    state        smallint    NOT NULL,               -- 1 in flight, 2 complete
    fingerprint  bytea       NOT NULL,               -- request fingerprint ("v1:…")
    token        text        NOT NULL,               -- lock token of the current claim
    created_at   timestamptz NOT NULL,               -- first claim
    lease_until  timestamptz NOT NULL,               -- in-flight lease deadline
    expires_at   timestamptz NOT NULL,               -- counts as absent from then on
    status       integer,                            -- stored response (complete only)
    headers      jsonb,                              -- {"Name": ["value", {"b64": "…"}]}
    body         bytea,
    body_omitted boolean     NOT NULL DEFAULT false,
    ref          bytea,                              -- idem.SetRef reference
    PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS idem_records_expires_at_idx ON idem_records (expires_at);
