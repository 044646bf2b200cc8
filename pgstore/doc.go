// Package pgstore keeps idem records in PostgreSQL, through a pgx v5
// *pgxpool.Pool. Its Store implements idem.Store, idem.TxStore (the handler's
// business writes and the stored response commit in one transaction) and
// idem.SingleTxStore (the single-transaction flow, idem.FlowSingleTx).
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	store, err := pgstore.New(pool, nil) // table idem_records
//	err = store.Migrate(ctx)             // or apply pgstore.Migrations with your tool
//	mw, err := idem.New(store, nil)
//	http.Handle("POST /orders", mw(createOrder))
//
// # Handlers and the transaction
//
// For every request it executes, the middleware opens a transaction and puts it in
// the request context; the handler gets it with Tx and does its writes in it:
//
//	func createOrder(w http.ResponseWriter, r *http.Request) {
//		tx := pgstore.Tx(r.Context())
//		var id int64
//		err := tx.QueryRow(r.Context(), `INSERT INTO orders (item) VALUES ($1) RETURNING id`, item).Scan(&id)
//		…
//		w.WriteHeader(http.StatusCreated)
//	}
//
// The middleware writes the response into the same transaction and commits it
// before the client hears anything: the order and the stored answer both exist,
// or neither does. Tx returns nil outside a request idem executes (an unkeyed
// method, or no key on a route with idem.Config.KeyOptional); such a handler uses
// the pool.
//
// The handler does not commit the transaction: Commit on it commits nothing and
// returns an error. When a statement fails, PostgreSQL aborts the whole
// transaction; if the handler then answers an error (say 409 after a unique
// violation), the middleware learns from the commit that nothing was committed
// (idem.ErrTxAborted) and keeps that answer on its own, so retries replay it.
// The same holds when the handler calls Rollback. To go on writing after an
// expected error, run the statement in a savepoint:
//
//	sp, err := tx.Begin(ctx) // SAVEPOINT
//	_, err = sp.Exec(ctx, `INSERT …`)
//	if isUniqueViolation(err) { _ = sp.Rollback(ctx) } else { _ = sp.Commit(ctx) }
//
// A COMMIT sent as SQL through the transaction commits the handler's writes
// outside the middleware's control; the response is then stored on its own, as
// by a store without transactions. Once the transaction is over, every method of
// the Tx returns pgx.ErrTxClosed, also for goroutines the handler left behind
// (Conn and LargeObjects are not guarded).
//
// # Which flow
//
// The single transaction (idem.FlowSingleTx, the store's preferred flow, which
// idem.FlowAuto picks) takes a transaction-scoped advisory lock on the key
// instead of writing a claim, and writes the record once, already complete,
// with the one COMMIT. A first-time request costs three round trips and one
// commit, the least a transaction with an in-flight lock can cost: BEGIN, the
// lock and the record lookup pipelined (the lookup runs after the lock was
// granted, so it sees what any earlier holder committed); the handler's
// statements; the record INSERT pipelined with COMMIT. The lock is tried only
// when no record is live at the request's clock reading, and a live record
// answers the request without it, so retries of a completed key replay side by
// side and never hold the key from a request for which it has just expired. A crash frees the key at once, because the lock dies
// with the connection. It holds a connection and a transaction for the
// handler's whole run, so it suits handlers whose effects all live in this
// database.
//
// Claim-then-complete (idem.FlowClaimComplete) commits an in-flight claim with a
// lease first (asynchronously, one round trip), runs the handler in a
// transaction while renewing the lease, and commits the completion with the
// business writes: four round trips and two commits for a first-time request.
// A crashed holder's key is taken over when its lease lapses. Choose it for
// handlers that call other services or may run long, and whenever other stores
// share the keys.
//
// Both flows may serve the same table and keys at once: a single-transaction
// request that finds a claim in its way when it writes its record rolls back
// and answers 409, so only one of them commits; one that finds a crashed
// claim's lapsed lease takes it over through the claim.
//
// # Schema
//
// Migrate creates this (shown for the default table name; Config.Table may name
// another table or schema):
//
//	CREATE TABLE IF NOT EXISTS idem_records (
//	    scope        bytea       NOT NULL,  -- tenant or principal (any bytes)
//	    key          bytea       NOT NULL,  -- the Idempotency-Key
//	    state        smallint    NOT NULL,  -- 1 in flight, 2 complete
//	    fingerprint  bytea       NOT NULL,
//	    token        text        NOT NULL,  -- lock token of the current claim
//	    created_at   timestamptz NOT NULL,
//	    lease_until  timestamptz NOT NULL,
//	    expires_at   timestamptz NOT NULL,
//	    status       integer,               -- the stored response (complete only)
//	    headers      jsonb,                 -- {"Name": ["value", {"b64": "…"}]}
//	    body         bytea,
//	    body_omitted boolean     NOT NULL DEFAULT false,
//	    ref          bytea,                 -- idem.SetRef reference
//	    PRIMARY KEY (scope, key)
//	);
//	CREATE INDEX IF NOT EXISTS idem_records_expires_at_idx ON idem_records (expires_at);
//
// Scope, key, fingerprint and reference are bytea because they may hold any bytes
// (text cannot hold NUL). Header values that are not valid UTF-8 or contain NUL
// are stored as {"b64": …}, so every header replays byte for byte.
//
// Migrations holds the same schema as versioned files (001_create.up.sql and
// .down.sql) for goose, golang-migrate or atlas. Every migration is written to be
// re-run; Migrate applies them all in one transaction under an advisory lock, so
// every instance of a service may call it at start.
//
// # The claim
//
// One statement decides every race ($5 is the middleware's clock reading, never
// now() in SQL, so that tests can drive time):
//
//	WITH cur AS (             -- a live record that cannot be claimed now
//	    SELECT … FROM idem_records
//	    WHERE scope = $1 AND key = $2 AND expires_at > $5
//	      AND NOT (state = 1 AND lease_until <= $5 AND fingerprint = $3)
//	), ins AS (
//	    INSERT INTO idem_records AS r (scope, key, state, fingerprint, token, created_at, lease_until, expires_at)
//	    SELECT $1, $2, 1, $3, $4, $5, $6, $7 WHERE NOT EXISTS (SELECT FROM cur)
//	    ON CONFLICT (scope, key) DO UPDATE SET
//	        state = 1, fingerprint = excluded.fingerprint, token = excluded.token,
//	        created_at = CASE WHEN r.expires_at <= excluded.created_at
//	                          THEN excluded.created_at ELSE r.created_at END,
//	        lease_until = excluded.lease_until, expires_at = excluded.expires_at,
//	        status = NULL, headers = NULL, body = NULL, body_omitted = false, ref = NULL
//	    WHERE r.expires_at <= excluded.created_at                       -- expired: replaced whole
//	       OR (r.state = 1 AND r.lease_until <= excluded.created_at     -- lapsed lease, same request:
//	           AND r.fingerprint = excluded.fingerprint)               -- taken over, created_at kept
//	    RETURNING …
//	)
//	SELECT true, * FROM ins UNION ALL SELECT false, * FROM cur
//
// A replay or a 409 is answered from cur without writing or locking anything. The
// INSERT … ON CONFLICT locks a conflicting row and re-checks its WHERE on the
// newest version, so of any number of concurrent claims exactly one wins. When the
// statement returns no row, a concurrent claim won after its snapshot; Claim then
// reads the row, and claims again if it vanished or became claimable meanwhile.
//
// The claim runs pipelined in one round trip as BEGIN; SET LOCAL
// synchronous_commit TO off; claim; COMMIT, so it does not wait for a WAL flush.
// That is safe: the completion commits synchronously, and WAL is flushed in
// order, so a durable completion implies a durable claim. A claim lost in a
// database crash only lets the retry execute at once instead of after the dead
// holder's lease, and it would execute then anyway. Config.SynchronousClaim turns
// this off.
//
// Complete, Release and Extend are compare-and-set on the lock token
// (… WHERE scope = $1 AND key = $2 AND token = $3 AND state = 1) and return
// idem.ErrLockLost when no row matched.
//
// Inside a request's transaction the last write costs no round trip of its own:
// the fenced completion (claim-then-complete) and the record insert (single
// transaction) are sent in one pipelined batch with COMMIT, wrapped as
//
//	WITH done AS (UPDATE … RETURNING 1) SELECT 1 / count(*) FROM done
//
// so that a write that matched no row raises division_by_zero, the transaction
// aborts, the COMMIT behind it does nothing, and Tx.Commit returns
// idem.ErrLockLost (LockedTx.Commit: idem.ErrInFlight). When the lookup found no
// row at all, the single transaction's record insert is a plain INSERT, which
// fails with unique_violation, to the same effect, when a claim appeared since. Commit always ends the
// transaction: rolled back unless committed, the connection back in the pool.
// When the connection fails after COMMIT was sent, Commit says the outcome is
// unknown: the fenced release the middleware then sends changes nothing if the
// commit went through.
//
// # The janitor
//
// Expired records count as absent at once; idem.Janitor deletes them in bounded
// batches that skip rows other transactions hold, so it never waits on or blocks
// a request:
//
//	DELETE FROM idem_records WHERE ctid = ANY(ARRAY(
//	    SELECT ctid FROM idem_records WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
//	)) AND expires_at <= $1
//
// # Step records
//
// The Store is an idem.StepStore: the records of idem.Step live in a table of
// their own, the records table's name with "_steps" (idem_records_steps; a
// hashed name when that would pass 63 bytes; see StepsTable), in the same
// schema, created by migration 002_create_steps (migration 003_steps_fingerprint
// adds the fingerprint of the request that wrote each row):
//
//	CREATE TABLE idem_records_steps (
//	    scope       bytea       NOT NULL,
//	    key         bytea       NOT NULL,
//	    name        text        NOT NULL,
//	    state       smallint    NOT NULL,  -- 1 started, 2 done, 3 failed
//	    owner       text        NOT NULL,  -- '' once abandoned
//	    derived_key text        NOT NULL,
//	    result      bytea,                 -- NULL while started
//	    started_at  timestamptz NOT NULL,
//	    expires_at  timestamptz NOT NULL,
//	    attempt     text        NOT NULL,  -- nonce of the BeginStep that last began it
//	    fingerprint bytea       NOT NULL DEFAULT '',  -- the request's (migration 003)
//	    PRIMARY KEY (scope, key, name)
//	);
//
// Each method is one statement in one round trip (pipelined with BEGIN and
// COMMIT at READ COMMITTED, whatever the session default), on a pool
// connection of its own: it commits at once and never waits for the handler's
// transaction (Tx) or the single transaction's locked one, which hold no lock
// it needs. BeginStep first looks, in the statement's snapshot, for a live
// record it may not take and whose expiry it would not move (with Holder,
// while the request record is held): that is the answer, and nothing is
// written — a replay of a done step costs no row lock and no commit flush.
// Otherwise an INSERT … ON CONFLICT … DO UPDATE … RETURNING in the same
// statement decides, whose CASEs take the step (absent or expired; started and abandoned; or of another
// owner with Rerun) or leave it, moving only its expiry; it returns the row
// after the decision, and whether this call took it (attempt = its nonce).
// With Holder the INSERT's rows come from a read of the request record —
// state 1, token = owner, expires_at > now — locked FOR SHARE until the
// statement commits, so that no takeover commits between the check and the
// write; no row means the fence failed. A FOR SHARE lock is no update: a
// REPEATABLE READ or SERIALIZABLE handler transaction that later completes the
// record does not fail for it. FinishStep and AbandonStep are UPDATEs fenced on
// (owner, state 1, live); SettleStep an UPDATE or DELETE; DeleteExpiredSteps
// deletes in bounded batches as DeleteExpired does. Times are the caller's
// clock readings, never now().
//
// # Limits
//
//   - Scope and key are at most 1024 bytes each (PostgreSQL indexes at most about
//     2,700 bytes per row); longer ones are refused with an error that says so.
//     idem.New hands stores at most 128 and 255 bytes.
//   - Settings the handler changes with SET (not SET LOCAL) stay on the pooled
//     connection after the request; SET LOCAL statement_timeout or search_path
//     also applies to the completion sent with COMMIT. Use SET LOCAL, and keep
//     the default table schema-qualified if handlers change search_path.
//   - Every isolation level works, as the session default (per role or
//     database) or set by the handler with SET TRANSACTION (Tx.Exec, Query or QueryRow), as its first
//     statement, in claim-then-complete (sent after another statement, it is
//     PostgreSQL's to refuse, 25001, as without idem; in the single
//     transaction idem's lookup is the first statement, so it is always
//     refused there, with an error that says to use claim-then-complete or the
//     session default). idem's own statements outside the handler's
//     transaction (claim, renewal, release) run at READ COMMITTED whatever the
//     default. While a claimed handler's transaction runs, its session holds
//     the key's advisory lock, and the renewals leave the record's row alone:
//     an UPDATE committed after the handler's snapshot would make the
//     completion fail under REPEATABLE READ and SERIALIZABLE. The lock proves
//     the holder alive instead (no takeover, no janitor delete, Get reports
//     the lease live). A serialization failure or deadlock in the handler's
//     transaction is idem.ErrTxConflict: 503 idempotency_transaction_conflict,
//     the key released. SERIALIZABLE as the session default costs conflicts
//     among concurrent requests with distinct keys (docs/design.md,
//     "Isolation levels", has the figures); prefer READ COMMITTED for idem's
//     routes, or set SERIALIZABLE where a handler needs it.
//   - A claim-then-complete request holds two pool connections while its handler
//     runs (the transaction, and briefly one for lease renewal); a single-transaction
//     request holds one. Size pgxpool's MaxConns for the concurrency you serve:
//     renewals share the pool with the handlers' transactions, so with every
//     connection held by a running handler a renewal waits, gives up after
//     Lease/3 and tries again; once Lease (30 s by default) passes without one,
//     another request may take the key over (fenced: the first commits nothing,
//     but its handler ran). Keep the concurrent claim-then-complete requests
//     below MaxConns — MaxConns of twice the concurrency leaves every handler a
//     connection for its claim and renewals — or limit the concurrency in front.
//     A step (idem.Step) needs one more connection, briefly, beside its
//     handler's transaction: with every connection held by handlers that wait
//     for one, the step's statement gives up after 5 s with an error that says
//     to raise MaxConns (the step is not begun, or its outcome not recorded),
//     rather than every such request waiting for the others for ever.
//     At REPEATABLE READ and SERIALIZABLE the lock proves the holder alive and a
//     starved renewal costs nothing.
//   - At REPEATABLE READ or SERIALIZABLE, the single transaction's lookup reads
//     the snapshot its first statement took, just before the advisory lock was
//     granted. A request that gets the lock the instant its holder committed can
//     miss that holder's record: its handler then runs, its record insert fails
//     at COMMIT (unique violation), nothing it wrote commits and it answers 409;
//     the retry replays. Nothing commits twice, but such a handler's calls outside
//     the database happen; use READ COMMITTED, or claim-then-complete, for
//     handlers with outside effects.
//   - The advisory lock key is a 64-bit hash of Config.Table (as spelled), scope
//     and key: an unrelated application's advisory lock on the same number would
//     look like a request in flight (409), never like a free key. Spell the table
//     the same way in every service that shares it; if two spellings race, the
//     record insert at COMMIT still lets only one of them commit.
//   - Statements are prepared and cached by pgx; behind PgBouncer in transaction
//     mode use a pool whose DefaultQueryExecMode is QueryExecModeExec.
//   - The response body is kept in one bytea value (PostgreSQL's limit is 1 GB;
//     idem.Config.MaxStoredBody defaults to 1 MiB).
package pgstore
