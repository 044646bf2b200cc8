// Package mysqlstore keeps idem records in MySQL (8.0 and later) or MariaDB (10.6
// and later), through database/sql. It implements idem.Store, idem.TxStore (the
// handler's business writes and the stored response commit in one transaction) and
// idem.SingleTxStore (the single-transaction flow).
//
// The store registers no driver. Open the *sql.DB yourself, with
// github.com/go-sql-driver/mysql (the driver it is tested with) or another:
//
//	import _ "github.com/go-sql-driver/mysql"
//
//	db, err := sql.Open("mysql", "app:secret@tcp(db:3306)/shop")
//	store, err := mysqlstore.New(db, nil)
//	err = store.Migrate(ctx) // once, at start-up or deploy
//	mw, err := idem.New(store, nil)
//	http.Handle("POST /orders", mw(createOrder))
//
// and write through the request's transaction in the handler, with Conn:
//
//	q := mysqlstore.Conn(r.Context())
//	res, err := q.ExecContext(r.Context(), "INSERT INTO orders (item) VALUES (?)", item)
//
// Conn is the request's *sql.Conn in the single-transaction flow (the default),
// on which the store runs the transaction itself, and the request's *sql.Tx
// otherwise. Tx, which hands the handler a *sql.Tx in every flow, still works,
// at the price of three more round trips per first-time request (database/sql's
// START TRANSACTION and COMMIT, and the savepoint again).
//
// No DSN option is required: times are stored as BIGINT Unix microseconds, so
// parseTime and loc do not matter, and affected-row counts are right with or
// without clientFoundRows. multiStatements=true makes the store faster (see
// "Round trips" below), and interpolateParams=true makes each of the handler's
// parameterised statements one round trip instead of two or three (prepare,
// execute, close); both are detected, never required, and the fastest
// configuration is both: root@tcp(db:3306)/shop?multiStatements=true&interpolateParams=true.
//
// # Schema
//
// Migrate creates it (the embedded Migrations, under a GET_LOCK so that concurrent
// starts are safe) and records the applied versions in Table+"_migrations":
//
//	CREATE TABLE IF NOT EXISTS `idem_records` (
//	  `scope`        VARBINARY(255)    NOT NULL,
//	  `key`          VARBINARY(255)    NOT NULL,
//	  `state`        TINYINT UNSIGNED  NOT NULL,  -- 1 in flight, 2 complete
//	  `fingerprint`  VARBINARY(512)    NOT NULL,
//	  `token`        VARBINARY(255)    NOT NULL,
//	  `created_at`   BIGINT            NOT NULL,  -- Unix microseconds
//	  `lease_until`  BIGINT            NOT NULL,
//	  `expires_at`   BIGINT            NOT NULL,
//	  `renewals`     BIGINT UNSIGNED   NOT NULL DEFAULT 0,
//	  `status`       SMALLINT UNSIGNED NULL,
//	  `headers`      MEDIUMBLOB        NULL,      -- JSON object of string arrays, or binary (below)
//	  `body`         LONGBLOB          NULL,
//	  `body_omitted` TINYINT(1)        NOT NULL DEFAULT 0,
//	  `ref`          BLOB              NULL,
//	  PRIMARY KEY (`scope`, `key`),
//	  KEY `expires_at_idx` (`expires_at`)
//	) ENGINE=InnoDB
//
// scope and key are VARBINARY, so they compare byte for byte: "ABC" and "abc",
// "k" and "k ", "straße" and "strasse" are different keys whatever the server's
// collation (a utf8mb4 _ci column would merge them, and two clients' operations
// with them). headers holds the stored response headers as a JSON object of
// string arrays when every name and value is valid UTF-8, as earlier versions
// wrote them; otherwise in a binary encoding that keeps every byte (the byte 0x01,
// then the number of names, and for each the name and its values, every number an
// unsigned varint and every string its length and bytes), so that a Location
// with a Latin-1 file name replays byte for byte. The user needs SELECT, INSERT, UPDATE and DELETE on the table, and
// CREATE to run Migrate.
//
// # The claim
//
// One statement decides every race for a key, with the row lock InnoDB takes on
// the primary key:
//
//	INSERT INTO t (scope, key, state, fingerprint, token, created_at, lease_until, expires_at)
//	VALUES (:scope, :key, 1, :fp, :token, :now, :lease, :expires)
//	ON DUPLICATE KEY UPDATE
//	  token       = IF(C, :token, token),
//	  created_at  = IF((token = :token OR C) AND expires_at <= :now, :now, created_at),
//	  state       = IF(token = :token OR C, 1, state),
//	  fingerprint = IF(token = :token OR C, :fp, fingerprint),
//	  lease_until = IF(token = :token OR C, :lease, lease_until),
//	  expires_at  = IF(token = :token OR C, :expires, expires_at),
//	  …           -- renewals, status, headers, body, body_omitted, ref reset likewise
//
//	-- where C = expires_at <= :now OR (state = 1 AND lease_until <= :now AND fingerprint = :fp)
//
// An absent key is inserted; a present one is replaced when it expired, or taken
// over when it is in flight with a lapsed lease and the same fingerprint (keeping
// created_at); otherwise nothing changes. The statement means the same whatever
// order the server applies the assignments in. MySQL (and MariaDB by default)
// apply them left to right, each seeing the columns the earlier ones changed: C is
// evaluated first on the untouched row and decides whether our fresh random token
// goes in, and every later assignment finds "token = :token" true exactly when it
// did. MariaDB under sql_mode SIMULTANEOUS_ASSIGNMENT (part of sql_mode=ORACLE)
// shows every assignment the old row, where our token never is, and C itself
// decides each one. The conformance suite runs under both.
// In the same transaction, still holding the row lock, the row is read back
// (SELECT … FOR UPDATE): the claim succeeded exactly when the stored token is ours,
// and otherwise the row is the record as it was when the claim was decided.
// Concurrent claims of one key serialise on the row lock; when InnoDB resolves a
// deadlock between them (error 1213) the claim is retried, so a race never turns
// into a 503. There is no check-then-write anywhere, and times are compared with
// the Now the middleware passed, never the server's clock.
//
// A key the read below finds absent is first claimed with a plain INSERT of the
// in-flight record, in one round trip and without a transaction: it succeeds
// exactly when no row exists, and the row is then the one inserted. When it
// fails with a duplicate key (another request got there first), the statement
// above decides.
//
// Before all that, Claim reads the committed row without locking it. When
// the row, as read, fails the same condition (complete and live, or in flight
// under a live lease or with another fingerprint), the statement would have failed
// at that instant too, so the claim is answered "no" with the row as read. The read
// can only say no; every "yes" comes from the INSERT. Replays and 409s therefore
// cost one round trip and take no row lock: a burst of retries of one key does not
// queue on it.
//
// Complete, Release and Extend are compare-and-set statements on (token, state = 1)
// and return idem.ErrLockLost when no row matched. Complete sets state to 2 and
// Extend bumps renewals, so a matched row always counts as changed (MySQL reports
// changed, not matched, rows unless clientFoundRows is set).
//
// # Transactions
//
// BeginTx opens a READ COMMITTED transaction (see Store.BeginTx for why) that the
// handler reaches with Tx. On a server that writes a statement-based binary log
// (log_bin on, binlog_format=STATEMENT), where InnoDB refuses writes under READ
// COMMITTED (error 1665), it opens REPEATABLE READ transactions instead: the
// store reads log_bin, sql_log_bin and binlog_format once, on first use, and
// switches if a completion meets error 1665 later. The middleware writes the completion into it with the
// same fenced UPDATE and commits: the business rows and the stored response exist
// together or not at all, and a request whose lease was taken over finds its token
// gone, so its transaction is rolled back. The claim itself commits on its own
// before the handler runs (claim-then-complete).
//
// InnoDB may end the transaction on its own: it rolls the whole transaction back
// when it picks it as a deadlock victim (error 1213), or on a lock wait timeout
// (1205) under innodb_rollback_on_timeout, and the session leaves it. In
// autocommit mode every later statement would then commit by itself — the
// handler's, when it ignores the error, and the completion — and a stored 201
// would replay an order that was rolled back. So the session runs the
// transaction with autocommit off (a statement after the rollback opens a new
// transaction, which is never committed), and the transaction starts with a
// savepoint that vanishes with a rollback. The completion (and the commit, when
// no completion came before it) first releases the savepoint; when it is gone,
// it reports idem.ErrTxAborted and nothing is committed: not the handler's writes
// before the abort, not those after it, not the completion. The middleware then
// rolls back. The connection's autocommit is turned back on before it returns to
// the pool (or the connection is closed). The guard's statements share round
// trips with others (see "Round trips").
// It does not cover a handler that ends the transaction itself (COMMIT, or a
// statement with an implicit commit such as CREATE TABLE): never do that in the
// request's transaction.
//
// A statement that fails without ending the transaction (a duplicate key the
// handler answers 409 for, a value the column refuses) leaves the transaction
// usable: MySQL rolls back only that statement, and the handler's answer is
// stored with its other writes.
//
// A handler statement still running when the request's context ends (past
// Config.HandlerTimeout) is not cancelled on the server: go-sql-driver closes
// its connection, and the server runs the statement on until it notices (SLEEP
// checks every few seconds, most statements only when they end), holding the
// transaction's row locks meanwhile. Nothing of the transaction commits, and in
// the claim-then-complete flow the key is released at once; in the single
// transaction the key's lock belongs to that session, so retries get 409
// idempotency_key_in_use until the server ends it. Bound long statements on the
// server (max_statement_time on MariaDB, max_execution_time on MySQL) to bound
// that wait.
//
// Each executing request holds one pooled connection for its transaction, and
// claims, lease renewals and other requests need others: size
// sql.DB.SetMaxOpenConns (and the server's max_connections) for that. The store
// prepares its statements on connections it does not hold, before a request's
// transaction begins, so a pool fully held by transactions never stalls a
// completion.
//
// A step (idem.Step) needs one more connection, briefly, beside its handler's
// transaction. With the pool full when a step's statement starts, it runs on
// a connection it waits at most 5 s for, and then fails with an error that
// says to raise SetMaxOpenConns (the step is not begun, or its outcome not
// recorded): otherwise, with every connection held by handlers whose steps
// wait for one, every such request would wait for the others for ever. Size
// SetMaxOpenConns at twice the requests that run steps at once.
//
// # Single transaction
//
// The store also implements idem.SingleTxStore (idem.FlowSingleTx): BeginLocked
// takes one connection for the request and reads the record without any lock; a
// live record is answered from that read (a replay, a 422 for another request,
// a 409 for a claim-then-complete request in flight), with one round trip and
// no lock or transaction. Otherwise it takes a named lock on (scope, key) with
// GET_LOCK(name, 0) — held elsewhere means 409 at once —, begins a READ
// COMMITTED transaction (guarded as above) and reads the record again in it; the
// handler writes in it (through Conn); the record is inserted, already complete, just before
// the one COMMIT. GET_LOCK belongs to the session, not the transaction, so
// Commit and Rollback release it explicitly after ending the transaction, and
// close the connection instead of pooling it when the release cannot be
// confirmed; a process that dies loses its session, and the server frees the
// lock and rolls back. A request that finds the lock held reads the record
// again: a complete record is replayed (concurrent retries of a finished
// request do not get 409 from each other); none means 409. The lock name is
// "idem:" and a hash of database, table, scope and key. GET_LOCK is local to one
// server: on a multi-primary cluster (Galera, group replication in multi-primary
// mode) all writers for a table must go to one node, and a proxy that
// multiplexes sessions must pin them (ProxySQL and MaxScale do so for GET_LOCK).
//
// The store prefers this flow (idem.FlowPreferrer; idem.Config.Flow's default
// picks it): one commit, so one redo log flush, per request instead of two, and
// fewer round trips.
//
// # Round trips
//
// Every statement is a round trip to the server, and a first-time request is
// mostly waiting on them. The store sends as few as it can:
//
//   - The transaction guard and the key's lock share one statement: SET
//     autocommit = IF(GET_LOCK(name, 0) = 1, 0, 2), @@tx_isolation = '…'
//     (@@transaction_isolation on MySQL; without SESSION it sets the next
//     transaction's level only, leaving the pooled session's). A lock held
//     elsewhere makes the value 2, which autocommit refuses (error 1231), and
//     nothing changes. The lock's release and autocommit's return share one too:
//     SET autocommit = IF(RELEASE_LOCK(name) = 1, 1, 2).
//   - The single-transaction record and the completion are sent as SQL text,
//     every value a hexadecimal literal (the same bytes whatever the character
//     set or sql_mode; nothing in a value can change the statement). Responses
//     over 64 KiB go as parameters of a prepared statement instead.
//   - With go-sql-driver's multiStatements=true on the DSN, the statements of
//     each step go in one round trip. Single transaction: "SELECT the live
//     record; SET autocommit = IF(IF(FOUND_ROWS() > 0, 0, GET_LOCK(name, 0) =
//     1), 0, 2), @@tx_isolation = '…'; SAVEPOINT idem_tx; SELECT the record's
//     expiry" (the lock is tried only when the read returned nothing, and a
//     replay ends there, at the guard's error; with autocommit off, the
//     savepoint begins the transaction, at the isolation level just set), the
//     handler's statements on the same connection (Conn), and at the end
//     "RELEASE SAVEPOINT idem_tx; INSERT the record; COMMIT; SET autocommit =
//     IF(RELEASE_LOCK(name) = 1, 1, 2)". The transaction is the session's own,
//     not a *sql.Tx: database/sql sends no START TRANSACTION and no COMMIT of
//     its own. A handler that calls Tx gets a *sql.Tx begun then (START
//     TRANSACTION, which commits the transaction so far, in which nothing was
//     written, and the savepoint again); once it called Conn, Tx returns nil,
//     since that START TRANSACTION would commit what it wrote through Conn on
//     its own. Without multiStatements, a *sql.Tx from the start, as below.
//     BeginTx (claim-then-complete): after START TRANSACTION,
//     "COMMIT; SET …; SAVEPOINT idem_tx" (the COMMIT ends the empty
//     transaction, since the isolation level can only change between
//     transactions; with autocommit off, the savepoint begins the next). The
//     server stops at the first statement that fails. The store detects the
//     option on first use (two statements in one query are a syntax error
//     without it) and works the same without it, one statement per round trip.
//     multiStatements lets any query of the application carry several
//     statements, which makes SQL injection in it worse: use it with
//     parameterised queries only.
//
// Per request, besides the handler's statements (counted by TestRoundTrips,
// TestRoundTripsConn and TestReplayRoundTrips): single transaction, first time,
// 2 round trips with multiStatements and Conn (3 with the handler's one
// statement: the hand-written minimum), 5 with Tx, 9 without multiStatements;
// a replay, a 422 or a 409 for a record in flight, 1; claim-then-complete 7
// and 9 (the read and the INSERT of the claim, START TRANSACTION, the guard,
// the completion, COMMIT, autocommit back on). A database/sql transaction adds
// one round trip at each end that cannot carry anything else: START
// TRANSACTION, and a COMMIT of nothing after the store committed.
// The server answers each statement of a query with a packet of its own, so a
// statement costs the client a read even within one round trip.
//
// # Expired records
//
// Get and Claim treat a record with expires_at <= now as absent. The janitor
// (idem.Janitor, or `idem gc`) deletes them in bounded batches, each one statement
// that holds its locks briefly, using the expires_at index:
//
//	DELETE FROM t WHERE expires_at <= :now ORDER BY expires_at, scope, key LIMIT :batch
//
// (The primary-key columns in ORDER BY make the batch deterministic, as
// statement-based replication requires; the index on expires_at, which carries
// the primary key, still serves the order without a sort.)
//
// # Step records
//
// The Store is an idem.StepStore: the records of idem.Step live in
// Table+"_steps" (StepsTable), created by migration 002_create_steps
// (migration 003_steps_fingerprint adds the fingerprint of the request that
// wrote each row):
//
//	CREATE TABLE IF NOT EXISTS `idem_records_steps` (
//	  `scope`       VARBINARY(255)   NOT NULL,
//	  `key`         VARBINARY(255)   NOT NULL,
//	  `name`        VARBINARY(100)   NOT NULL,
//	  `state`       TINYINT UNSIGNED NOT NULL,  -- 1 started, 2 done, 3 failed
//	  `owner`       VARBINARY(255)   NOT NULL,  -- '' once abandoned
//	  `derived_key` VARBINARY(255)   NOT NULL,
//	  `result`      LONGBLOB         NULL,      -- NULL while started
//	  `started_at`  BIGINT           NOT NULL,  -- Unix microseconds
//	  `expires_at`  BIGINT           NOT NULL,
//	  `attempt`     VARBINARY(32)    NOT NULL,  -- nonce of the BeginStep that last began it
//	  `seq`         BIGINT UNSIGNED  NOT NULL DEFAULT 0,
//	  `fingerprint` VARBINARY(512)   NOT NULL DEFAULT '',  -- the request's (migration 003)
//	  PRIMARY KEY (`scope`, `key`, `name`),
//	  KEY `expires_at_idx` (`expires_at`)
//	) ENGINE=InnoDB
//
// Every step statement runs on a pool connection of its own and commits at
// once: it never joins, or waits for, the handler's transaction (Tx) or the
// single transaction, which lock no row it needs. A step's first BeginStep is
// one autocommitted INSERT … SELECT: with Holder the SELECT reads the request
// record (state 1, token = owner, live at now) LOCK IN SHARE MODE, so that no
// takeover commits between the check and the write, and no row selected means
// the fence failed. When the step's row exists (error 1062), BeginStep reads
// it — with its seq, which every write bumps, and with Holder whether the
// request record is held, in one snapshot — and decides in Go. A replay that
// moves no expiry writes nothing (two round trips in all). Otherwise one
// autocommitted UPDATE writes what changes (the owner of a step taken over,
// the later expiry, or a new record over an expired one), conditioned on seq
// and attempt being those read and, with Holder, on the request record read
// LOCK IN SHARE MODE: three round trips, and a row changed in between makes
// it read and decide again. After a few lost rounds (contention) one
// transaction decides instead: INSERT … SELECT … ON DUPLICATE KEY UPDATE,
// whose assignments take the row (absent or expired; started and abandoned;
// or another owner's with Rerun) or leave it, moving only its expiry —
// attempt is assigned first, to this call's nonce when it takes the row, and
// every later assignment asks "attempt = nonce OR take", so the statement
// decides the same under MySQL's left-to-right assignments and MariaDB's
// SIMULTANEOUS_ASSIGNMENT — then a read of the row, which sees the
// transaction's own write under its exclusive row lock, then COMMIT. seq
// changes with every write, so the affected-rows count tells "updated" (2)
// from "inserted" (1) and "fence failed" (0) with or
// without clientFoundRows. Under REPEATABLE READ, concurrent first BeginSteps
// of one step can deadlock on the duplicate key's next-key lock; InnoDB rolls
// one back, and it is retried (the other's row then decides). FinishStep,
// AbandonStep and SettleStep are one UPDATE or DELETE each, fenced on (owner,
// state 1, live); DeleteExpiredSteps deletes in bounded, deterministic batches
// as the janitor's DeleteExpired does. Times are the caller's clock readings.
// A handler must not lock idem's own record row (SELECT … FOR UPDATE on the
// records table): the holder fence's shared lock would wait for it.
//
// # Limits
//
//   - scope and key: at most 255 bytes each (MaxScopeLength, MaxKeyLength); longer
//     values are refused with an error before they reach the server, which outside
//     strict SQL mode would truncate them and merge distinct keys. Keep
//     idem.Config.MaxKeyLength at 255 or less, and hash long scopes.
//   - fingerprint at most 512 bytes, lock token at most 255. A longer custom
//     fingerprint (idem.Config.FingerprintFunc) is refused with an
//     *idem.FieldTooLargeError: the request is answered 500
//     idempotency_response_too_large, not retryable, and nothing is committed.
//   - A stored response travels in one packet: the server's max_allowed_packet
//     (16 MiB on MariaDB 10.11, 64 MiB on MySQL 8) must exceed the largest body plus
//     headers, or the store refuses the response with an *idem.FieldTooLargeError
//     for the body (read once with the store's settings, or the server's error
//     1153): nothing is committed and the request is answered 500
//     idempotency_response_too_large, not a retryable 503 every retry would meet
//     again. Keep idem.Config.MaxStoredBody (1 MiB by default) well below it.
//     body is a LONGBLOB, headers a MEDIUMBLOB (16 MiB), ref a BLOB (64 KiB).
//   - Config.Table: letters, digits, underscore, at most 53 characters, in the
//     DSN's database.
package mysqlstore
