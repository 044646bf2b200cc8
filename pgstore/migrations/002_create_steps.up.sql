-- pgstore schema, version 2: step records (idem.Step). One row per (scope, key,
-- name) of a request record; written on the store's own connections, outside
-- any business transaction. Idempotent, as every migration.
CREATE TABLE IF NOT EXISTS idem_records_steps (
    scope       bytea       NOT NULL,               -- the request record's scope
    key         bytea       NOT NULL,               -- the request record's key
    name        text        NOT NULL,               -- the step's name
    state       smallint    NOT NULL,               -- 1 started, 2 done, 3 failed
    owner       text        NOT NULL,               -- token of the execution running it; '' abandoned
    derived_key text        NOT NULL,               -- the step's Idempotency-Key, fixed at the first write
    result      bytea,                              -- recorded result or failure; NULL while started
    started_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,               -- counts as absent from then on
    attempt     text        NOT NULL,               -- nonce of the BeginStep that last began it
    PRIMARY KEY (scope, key, name)
);

CREATE INDEX IF NOT EXISTS idem_records_steps_expires_at_idx ON idem_records_steps (expires_at);
