// Package sqlitestore keeps idem records in a SQLite database, through
// database/sql. It implements idem.Store, idem.TxStore and idem.SingleTxStore:
// the handler's business writes and the stored response commit in one SQLite
// transaction, so the order and its recorded answer both exist, or neither does.
//
// The package registers no driver. Open the database with
// sqlitestore/embedded.Open (the pure-Go modernc.org/sqlite driver, set up as
// described below), or with any SQLite driver opened with the same settings.
//
//	db, err := embedded.Open("app.db")
//	store, err := sqlitestore.New(db, nil)
//	err = store.Migrate(ctx)
//	mw, err := idem.New(store, nil)
//	http.Handle("POST /orders", mw(createOrder))
//
//	func createOrder(w http.ResponseWriter, r *http.Request) {
//		tx := sqlitestore.Tx(r.Context()) // the request's transaction
//		_, err := tx.ExecContext(r.Context(), "INSERT INTO orders …")
//		…
//	}
//
// # Schema
//
// Migrate creates the table (Config.Table, default idem_records) from the
// embedded, versioned migrations (Migrations) and records the versions applied
// in idem_migrations. Times are integer Unix nanoseconds (UTC, good until the
// year 2262); a record counts while expires_at is greater than the caller's
// clock reading. The table is clustered on its primary key (WITHOUT ROWID) and
// has no other index: a record is one entry in one B-tree. Version 2 moved
// tables of version 1 (a rowid table with an expires_at index) to this shape,
// copying every record as it was; a process of an older release keeps serving
// requests on the new table, but its janitor fails (its statement names the
// rowid) until it is upgraded.
//
//	CREATE TABLE idem_records (
//	    scope        TEXT    NOT NULL,
//	    key          TEXT    NOT NULL,
//	    state        INTEGER NOT NULL CHECK (state IN (1, 2)), -- 1 in flight, 2 complete
//	    fingerprint  TEXT    NOT NULL,
//	    token        TEXT    NOT NULL,
//	    created_at   INTEGER NOT NULL,
//	    lease_until  INTEGER NOT NULL,
//	    expires_at   INTEGER NOT NULL,
//	    status       INTEGER,          -- NULL while in flight
//	    headers      TEXT,             -- JSON object of string arrays, NULL when none
//	    body         BLOB,
//	    body_omitted INTEGER NOT NULL DEFAULT 0 CHECK (body_omitted IN (0, 1)),
//	    ref          TEXT,
//	    PRIMARY KEY (scope, key)
//	) WITHOUT ROWID;
//
// # Claim
//
// One statement decides every claim that writes. ?5 is the middleware's clock
// reading (ClaimRequest.Now), never SQLite's clock:
//
//	INSERT INTO idem_records AS r (scope, key, state, fingerprint, token, created_at, lease_until, expires_at)
//	VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, ?7)
//	ON CONFLICT (scope, key) DO UPDATE SET
//	    state = 1, fingerprint = excluded.fingerprint, token = excluded.token,
//	    created_at = CASE WHEN r.expires_at <= ?5 THEN excluded.created_at ELSE r.created_at END,
//	    lease_until = excluded.lease_until, expires_at = excluded.expires_at,
//	    status = NULL, headers = NULL, body = NULL, body_omitted = 0, ref = NULL
//	WHERE r.expires_at <= ?5                                   -- expired: replaced whole
//	   OR (r.state = 1 AND r.lease_until <= ?5                  -- lapsed lease, same request:
//	       AND r.fingerprint = excluded.fingerprint)            -- taken over, created_at kept
//	RETURNING created_at
//
// A returned row means the claim won. No row means the record exists and may not
// be claimed; Claim then reads it and returns it (and decides again, a bounded
// number of times, if another process changed it in between). Before that
// statement, Claim reads the record without any lock: when it is complete, or in
// flight under a live lease or another fingerprint, nothing can be written and
// the read is the answer. Replays and 409s therefore never wait for the write
// lock, even while a long handler holds it.
//
// Complete, Release and Extend are compare-and-set on (scope, key, token,
// state = 1); no row changed is idem.ErrLockLost. Get treats expired records as
// absent (idem.ErrNotFound).
//
// # Janitor
//
// DeleteExpired deletes in bounded batches. Without an index on expires_at
// (which every insert would have to write), it walks the primary key: a read
// without any lock finds the next expired keys after where the previous batch
// stopped, then a statement under the write lock deletes the expired records of
// that key range (a range scan of the keys just read, re-checked at now):
//
//	SELECT scope, key FROM idem_records
//	WHERE (scope, key) > (?, ?) AND expires_at <= ? ORDER BY scope, key LIMIT ?
//
//	DELETE FROM idem_records WHERE (scope, key) IN (SELECT scope, key FROM idem_records
//	    WHERE (scope, key) > (?, ?) AND (scope, key) <= (?, ?) AND expires_at <= ?
//	    ORDER BY scope, key LIMIT ?)
//
// The Store remembers where a batch stopped; at the end of the table the next
// batch starts again from its beginning. Run idem.Janitor (or `idem gc`) with
// the store: a sweep reads the whole table once, without the write lock, and
// each batch holds the lock only for deleting what it found.
//
// # One writer
//
// SQLite allows one write transaction at a time per database file. embedded.Open
// sets the database up for that:
//
//   - WAL journal mode: readers do not block the writer, nor the writer readers.
//     Claim's first read, Get, replays and 409 answers run while a handler holds
//     the write lock.
//   - busy_timeout = 10 s: a writer that finds the lock taken by another process
//     (or by the application's own writes outside idem) waits up to 10 s, then
//     fails with SQLITE_BUSY. idem answers that request 503, and the handler has
//     not run.
//   - BEGIN IMMEDIATE (_txlock=immediate): a transaction takes the write lock
//     when it begins. A deferred transaction that read first would fail at once
//     with SQLITE_BUSY, without waiting, when it later tried to write after
//     another connection had written. BeginTx takes the lock at once whatever the
//     driver's BEGIN mode, by running a write that changes nothing first.
//
// Within one process the store queues its own writes (Claim's statement,
// Complete, Release, Extend, DeleteExpired, and every transaction from BeginTx to
// Commit or Rollback) in a FIFO gate shared by all Stores on the same *sql.DB, in
// front of SQLite's lock. The lock then passes from writer to writer at once and
// in arrival order, where SQLite's busy handler would poll with sleeps of up to
// 100 ms, and concurrent requests of one process never fail with SQLITE_BUSY. A
// wait in the gate ends with an error after Config.LockTimeout (10 s), or when the
// request's context ends.
//
// What this means for the middleware (claim-then-complete flow with a TxStore):
//
//   - The request's transaction, and with it the write lock, is held from just
//     before the handler runs until the completion commits. Every other write to
//     the file, of any key, waits meanwhile. Keep handlers short; a handler that
//     calls slow outside services serializes the whole service behind it. Within
//     the handler, read and write through Tx(ctx) only: a write through the
//     *sql.DB would wait for the lock the handler's own transaction holds.
//   - Lease renewal cannot happen during the handler. The middleware renews the
//     lease every Lease/3 on another connection; that Extend waits for the write
//     lock the handler's transaction holds, times out after Lease/3, and is tried
//     again, without cancelling the handler (the middleware cancels a handler only
//     when renewal reports idem.ErrLockLost, never on a stall). So the lease of a
//     handler that runs longer than Lease lapses on paper.
//   - It does not matter: while the transaction holds the write lock nobody can
//     take the key over, in this process or any other, because a takeover is a
//     write. The lock itself fences the handler. When the handler returns, the
//     fenced completion runs in the same transaction and has the last word: it
//     succeeds unless the key was taken over before the transaction began (in the
//     moment between the claim's commit and BeginTx), in which case it fails with
//     ErrLockLost and the handler's writes roll back (409 idempotency_lease_lost).
//   - A lapsed lease matters only when the holder is gone: a crashed process
//     releases its lock with its file descriptors, its uncommitted writes vanish
//     from the WAL, and the key stays in flight until its lease lapses, after
//     which a retry takes it over and runs. Choose Lease as the time a retry
//     should wait after a crash, not as the longest handler.
//
// # Single-transaction flow
//
// The Store also implements idem.SingleTxStore (idem.FlowSingleTx), and prefers
// it (idem.FlowPreferrer): with idem.Config.Flow left at idem.FlowAuto, the
// middleware runs this flow. A first-time request costs one write transaction
// and one commit, as the handler alone would, against two commits in the
// claim-then-complete flow:
//
//	SELECT … FROM idem_records WHERE scope = ? AND key = ? AND expires_at > ?   -- no lock
//	BEGIN IMMEDIATE                                 -- waits for the write lock
//	UPDATE idem_records SET state = state           -- takes the write lock with any BEGIN
//	    WHERE scope = ? AND key = ? AND expires_at > ?  -- mode, and sees a record written
//	                                                -- since the SELECT: changes nothing
//	…the handler's statements…
//	INSERT INTO idem_records AS r (…all columns…) VALUES (…)   -- the record, complete
//	ON CONFLICT (scope, key) DO UPDATE SET …all columns… = excluded.…
//	WHERE r.expires_at <= ?   -- replaces only a record expired at the request's clock
//	COMMIT
//
// The first read decides without any lock when a live record exists: a replay,
// a 422, or a 409 for a claim-then-complete request in flight never waits for
// the write lock, and is answered while a handler holds it. SQLite has no lock
// per key (the write lock covers the whole file), so the key of a transaction in
// progress is kept in a set shared by every Store on the same *sql.DB: a second
// request for it gets idem.ErrInFlight at once (409), instead of waiting for the
// write lock. A request for the same key from another process waits for the
// write lock (under the busy timeout) and then finds the record, in the UPDATE
// above: a replay. Requests for other keys wait for the write lock, as every
// write does. A crash rolls everything back, nothing of the request remains, and
// the retry runs at once. There is no lease, and nothing to take over: prefer
// the claim-then-complete flow (idem.FlowClaimComplete) only for handlers with
// effects outside this database, or longer than the busy timeout.
//
// # Step records
//
// The Store is an idem.StepStore, and keeps the records of idem.Step in a
// database file of their own: a handler's transaction holds the records
// file's one write lock (BEGIN IMMEDIATE) from before the handler runs until
// its answer commits, so a step record written to that file would wait for
// the transaction that waits for the step (up to LockTimeout in this process,
// the busy timeout across processes). The steps file is the records file's
// path (PRAGMA database_list) with StepsFileSuffix, "app.db-steps", opened with
// the records database's driver, in WAL mode with synchronous=FULL (a step's
// record is what keeps the other service from being called twice, so its
// commit is flushed before the step returns), with a writer gate of its own.
// It is created at the first step (reads and the janitor of a store that never
// recorded one do not create it), and shared by every Store on one *sql.DB
// and, through SQLite's locks, by every process on the file; Store.Close of
// the last Store on the *sql.DB that recorded steps closes it (a Store used
// again opens it again). For an in-memory
// records database the step records live in an in-memory database of the
// process, on one connection kept open. Config.StepsDB chooses another
// database; it must be another file (the records' own is refused). The table
// is the records table's name with "_steps" (a steps file made before step
// records carried the request's fingerprint gets the column at the first
// step):
//
//	CREATE TABLE idem_records_steps (
//	    scope       TEXT    NOT NULL,
//	    key         TEXT    NOT NULL,
//	    name        TEXT    NOT NULL,
//	    state       INTEGER NOT NULL CHECK (state IN (1, 2, 3)), -- started, done, failed
//	    owner       TEXT    NOT NULL,                            -- '' once abandoned
//	    derived_key TEXT    NOT NULL,
//	    result      BLOB,                                        -- NULL while started
//	    started_at  INTEGER NOT NULL,                            -- Unix nanoseconds
//	    expires_at  INTEGER NOT NULL,
//	    attempt     TEXT    NOT NULL,                            -- nonce of the BeginStep that last began it
//	    fingerprint TEXT    NOT NULL DEFAULT '',                 -- the request's that wrote it
//	    PRIMARY KEY (scope, key, name)
//	);
//
// BeginStep first reads the step (and then, with Holder, the request record):
// a live record it may not take and whose expiry it would not move — a
// replay of a done step — is the answer, without the gate, a lock or a
// write. Otherwise it is one INSERT … ON CONFLICT DO UPDATE … RETURNING under
// the steps gate. With Holder it runs in a transaction of the steps file that
// first takes that file's write lock, then reads the request record and
// writes only when the record is in flight under the owner and live. The
// fence must hold from that check until the step's commit, so no takeover of
// the record may commit in between: inside the handler's transaction (the
// context carries Tx, as idem.Step passes it) none can, since that
// transaction holds the records file's write lock, and the read goes through
// that transaction (another connection of the pool would need one that a
// pool of one, SetMaxOpenConns(1), never frees while it runs); outside it (a claim-then-complete execution without
// the store's transaction, a consumer, a direct call) BeginStep takes the
// records file's write lock itself — its gate, then the steps', always in
// that order — until the step has committed. So call BeginStep with Holder
// inside a transaction of the store only with a context that carries it. The
// others are one statement each. Backups must copy both files.
//
// # Limits
//
//   - One database file on a local file system (WAL needs shared memory, so not
//     NFS). Several processes on one host may share it; they queue for the write
//     lock under the busy timeout.
//   - Write throughput is that of one writer: every first-time request costs two
//     commits in the claim-then-complete flow (the claim, then the transaction),
//     one in the single-transaction flow. Replays, 422s and 409s cost one read in
//     either flow and never wait for the write lock.
//   - A first-time request writes its record into one B-tree (the table is its
//     primary key): with the handler's own row, two to three pages per commit
//     written to the WAL, against one for a bare insert. A sweep of the janitor
//     reads the whole table (outside the write lock), where an expires_at index
//     would let it read only the expired records, at the price of a third
//     B-tree written by every request.
//   - Bodies are kept whole in the row; idem.Config.MaxStoredBody (1 MiB by
//     default) bounds them. SQLite's own limit is 1 GB per value.
package sqlitestore
