package sqlitestore

import (
	"context"
	"crypto/rand"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/idemkit/idem"
)

var _ idem.StepStore = (*Store)(nil)

// StepsFileSuffix is appended to the path of the records' database file to
// name the file sqlitestore keeps step records in (see "Step records" in the
// package documentation).
const StepsFileSuffix = "-steps"

// stepsState is a Store's handle on its step records' database.
type stepsState struct {
	cfg *sql.DB // Config.StepsDB, or nil

	mu     sync.Mutex
	db     *sql.DB      // once opened
	handle *stepsHandle // the shared handle db came from (nil: Config.StepsDB)
	gate   gate
	ready  bool // the table exists
	q      stepQueries
}

type stepQueries struct {
	begin, beginFirst, other, peek, finish, abandon, settle, forget, get, deleteExpired, lock, schema, columns, addFingerprint string
}

// stepsHandles holds the step database sqlitestore opened for each records
// *sql.DB (without Config.StepsDB), so that every Store on one *sql.DB uses
// one handle and one gate; an entry goes when its *sql.DB is garbage.
var stepsHandles sync.Map // weak.Pointer[sql.DB] -> *stepsHandle

type stepsHandle struct {
	once sync.Mutex
	db   *sql.DB
	path string // "" in memory
	refs int    // Stores using db (steps file only), see release
}

func stepsHandleFor(db *sql.DB) *stepsHandle {
	k := weak.Make(db)
	if h, ok := stepsHandles.Load(k); ok {
		return h.(*stepsHandle)
	}
	h, loaded := stepsHandles.LoadOrStore(k, &stepsHandle{})
	if !loaded {
		runtime.AddCleanup(db, func(k weak.Pointer[sql.DB]) {
			if h, ok := stepsHandles.LoadAndDelete(k); ok {
				sh := h.(*stepsHandle)
				sh.once.Lock()
				sdb := sh.db
				sh.once.Unlock()
				if sdb != nil {
					_ = sdb.Close()
				}
			}
		}, k)
	}
	return h.(*stepsHandle)
}

func newStepQueries(table string) stepQueries {
	q := newStepQueries0(table)
	// beginFirst is begin with First: nothing inserted nor updated (no row
	// returned) while another request's row of the key lives.
	t := quoteIdent(table + "_steps")
	q.beginFirst = strings.Replace(q.begin, "VALUES (?1, ?2, ?3, 1, ?4, ?5, NULL, ?6, ?7, ?8, ?10)",
		"SELECT ?1, ?2, ?3, 1, ?4, ?5, NULL, ?6, ?7, ?8, ?10 WHERE NOT EXISTS (SELECT 1 FROM "+t+
			" AS o WHERE o.scope = ?1 AND o.key = ?2 AND o.expires_at > ?6 AND o.fingerprint <> '' AND o.fingerprint <> ?10)", 1)
	return q
}

func newStepQueries0(table string) stepQueries {
	t := quoteIdent(table + "_steps")
	idx := quoteIdent(table + "_steps_expires_at_idx")
	// other: a live row of another request (both fingerprints set, and
	// different), which BeginStep leaves as it is.
	other := `(s.expires_at > ?6 AND s.fingerprint <> '' AND ?10 <> '' AND s.fingerprint <> ?10)`
	take := `(s.expires_at <= ?6 OR (NOT ` + other + ` AND s.state = 1 AND (s.owner = '' OR (?9 AND s.owner <> excluded.owner))))`
	expired := `s.expires_at <= ?6`
	live := `scope = ? AND key = ? AND name = ? AND expires_at > ?`
	return stepQueries{
		schema: `CREATE TABLE IF NOT EXISTS ` + t + ` (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    name        TEXT    NOT NULL,
    state       INTEGER NOT NULL CHECK (state IN (1, 2, 3)), -- 1 started, 2 done, 3 failed
    owner       TEXT    NOT NULL,                            -- '' once abandoned
    derived_key TEXT    NOT NULL,
    result      BLOB,                                        -- NULL while started
    started_at  INTEGER NOT NULL,                            -- Unix nanoseconds
    expires_at  INTEGER NOT NULL,
    attempt     TEXT    NOT NULL,                            -- nonce of the BeginStep that last began it
    fingerprint TEXT    NOT NULL DEFAULT '',                 -- the request's that wrote it ('' for none)
    PRIMARY KEY (scope, key, name)
);
CREATE INDEX IF NOT EXISTS ` + idx + ` ON ` + t + ` (expires_at)`,
		// One statement decides BeginStep (the gate and SQLite's write lock
		// serialize it); attempt = ?8, this call's nonce, says whether it began.
		// A steps file made before step records carried the fingerprint
		// gets the column (every row's '': not told apart).
		columns:        `SELECT name FROM pragma_table_info('` + table + `_steps')`,
		addFingerprint: `ALTER TABLE ` + t + ` ADD COLUMN fingerprint TEXT NOT NULL DEFAULT ''`,
		begin: `INSERT INTO ` + t + ` AS s (scope, key, name, state, owner, derived_key, result, started_at, expires_at, attempt, fingerprint)
VALUES (?1, ?2, ?3, 1, ?4, ?5, NULL, ?6, ?7, ?8, ?10)
ON CONFLICT (scope, key, name) DO UPDATE SET
    attempt = CASE WHEN ` + take + ` THEN excluded.attempt ELSE s.attempt END,
    owner = CASE WHEN ` + take + ` THEN excluded.owner ELSE s.owner END,
    state = CASE WHEN ` + expired + ` THEN 1 ELSE s.state END,
    derived_key = CASE WHEN ` + expired + ` THEN excluded.derived_key ELSE s.derived_key END,
    result = CASE WHEN ` + expired + ` THEN NULL ELSE s.result END,
    started_at = CASE WHEN ` + expired + ` THEN excluded.started_at ELSE s.started_at END,
    fingerprint = CASE WHEN ` + expired + ` THEN excluded.fingerprint ELSE s.fingerprint END,
    expires_at = CASE WHEN ` + expired + ` THEN excluded.expires_at WHEN ` + other + ` THEN s.expires_at ELSE MAX(s.expires_at, excluded.expires_at) END
RETURNING attempt = ?8, state, owner, derived_key, result, started_at, expires_at, fingerprint`,
		// other: a live row of the key, of any name, of another request
		// than ?4's fingerprint (a range of the primary key).
		other: `SELECT name, state, owner, derived_key, result, started_at, expires_at, fingerprint FROM ` + t +
			` WHERE scope = ?1 AND key = ?2 AND expires_at > ?3 AND fingerprint <> '' AND fingerprint <> ?4 LIMIT 1`,
		peek:          `SELECT state, owner, derived_key, result, started_at, expires_at, fingerprint FROM ` + t + ` WHERE scope = ? AND key = ? AND name = ?`,
		finish:        `UPDATE ` + t + ` SET state = ?, result = ? WHERE ` + live + ` AND state = 1 AND owner = ? AND owner <> ''`,
		abandon:       `UPDATE ` + t + ` SET owner = '' WHERE ` + live + ` AND state = 1 AND owner = ? AND owner <> ''`,
		settle:        `UPDATE ` + t + ` SET state = ?, result = ? WHERE ` + live,
		forget:        `DELETE FROM ` + t + ` WHERE ` + live,
		get:           `SELECT name, state, owner, derived_key, result, started_at, expires_at, fingerprint FROM ` + t + ` WHERE scope = ? AND key = ? AND expires_at > ? ORDER BY started_at, name`,
		deleteExpired: `DELETE FROM ` + t + ` WHERE rowid IN (SELECT rowid FROM ` + t + ` WHERE expires_at <= ? LIMIT ?)`,
		lock:          `UPDATE ` + t + ` SET state = state WHERE 0`,
	}
}

// StepsDB returns the database the store keeps step records in, opening it
// (and creating its table) if needed: Config.StepsDB, or the file beside the
// records' database (its path with StepsFileSuffix), or, for an in-memory
// records database, a private in-memory database of this process.
func (s *Store) StepsDB(ctx context.Context) (*sql.DB, error) {
	db, _, err := s.steps(ctx, true)
	return db, err
}

// steps returns the step records' database and its gate. Without create it
// returns a nil *sql.DB, and no error, when sqlitestore would have to create
// the steps file (nobody recorded a step yet): reads and the janitor then
// find nothing, and a service that never uses steps never gets the file.
func (s *Store) steps(ctx context.Context, create bool) (*sql.DB, gate, error) {
	st := &s.st
	st.mu.Lock()
	if st.ready {
		defer st.mu.Unlock()
		return st.db, st.gate, nil
	}
	opened := st.db != nil
	st.mu.Unlock()
	// The files are read before st.mu is taken, through the transaction in
	// ctx when there is one: with a pool of one connection
	// (SetMaxOpenConns(1)) the handler's transaction holds it, and a read of
	// the records' *sql.DB would wait for it for ever, in st.mu, blocking
	// every other step of the process too (TestOneConnectionPoolSteps).
	var file string
	if !opened {
		var err error
		if file, err = mainFile(ctx, s.records(ctx)); err != nil {
			return nil, nil, recordsErr("steps: find the records' database file", err)
		}
		if st.cfg != nil {
			if st.cfg == s.db {
				return nil, nil, errors.New("sqlitestore: Config.StepsDB is the records' own *sql.DB; step records need a database file of their own (leave StepsDB nil for the file beside it)")
			}
			if err := checkOtherFile(ctx, file, st.cfg); err != nil {
				return nil, nil, err
			}
		}
	}
	st.mu.Lock()
	if st.db == nil && opened { // closed meanwhile: read the files again
		st.mu.Unlock()
		return s.steps(ctx, create)
	}
	defer st.mu.Unlock()
	if st.ready {
		return st.db, st.gate, nil
	}
	if st.db == nil {
		db := st.cfg
		if db == nil {
			h := stepsHandleFor(s.db)
			var err error
			if db, err = h.open(ctx, file, s.db.Driver(), create); err != nil || db == nil {
				return nil, nil, err
			}
			st.handle = h
		}
		st.db, st.gate = db, sharedFor(db).gate
	}
	unlock, err := st.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return nil, nil, wrap("steps: create the table", err)
	}
	defer unlock()
	if _, err := st.db.ExecContext(ctx, st.q.schema); err != nil {
		return nil, nil, wrap("steps: create the table", err)
	}
	if err := s.addFingerprint(ctx, st.db); err != nil {
		return nil, nil, err
	}
	st.ready = true
	return st.db, st.gate, nil
}

// addFingerprint adds the fingerprint column to a steps table made before
// step records carried it.
func (s *Store) addFingerprint(ctx context.Context, db *sql.DB) error {
	rows, err := db.QueryContext(ctx, s.st.q.columns)
	if err != nil {
		return wrap("steps: read the table's columns", err)
	}
	has := false
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			_ = rows.Close()
			return wrap("steps: read the table's columns", err)
		}
		has = has || name == "fingerprint"
	}
	if err := rows.Close(); err != nil {
		return wrap("steps: read the table's columns", err)
	}
	if has {
		return nil
	}
	if _, err := db.ExecContext(ctx, s.st.q.addFingerprint); err != nil && !strings.Contains(err.Error(), "duplicate column") {
		return wrap("steps: add the fingerprint column", err)
	}
	return nil
}

// mainFile returns the file of the main database db reads ("" in memory).
func mainFile(ctx context.Context, db interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}) (string, error) {
	rows, err := db.QueryContext(ctx, `PRAGMA database_list`)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	for rows.Next() {
		var seq int
		var name, file string
		var fileNull sql.NullString
		if err := rows.Scan(&seq, &name, &fileNull); err != nil {
			return "", err
		}
		file = fileNull.String
		if name == "main" {
			return file, rows.Close()
		}
	}
	if err := rows.Err(); err != nil {
		return "", err
	}
	return "", errors.New("PRAGMA database_list names no main database")
}

// checkOtherFile refuses a Config.StepsDB on the records' own file (file, ""
// in memory): a step inside the handler's transaction would wait for the
// write lock that transaction holds.
func checkOtherFile(ctx context.Context, a string, steps *sql.DB) error {
	b, err := mainFile(ctx, steps)
	if err != nil {
		return wrap("steps: find Config.StepsDB's file", err)
	}
	if a != "" && a == b {
		return fmt.Errorf("sqlitestore: Config.StepsDB opens %s, the records' own file; step records need a file of their own, or a step inside the handler's transaction would wait for the write lock that transaction holds", a)
	}
	return nil
}

// open opens the steps database beside db's main file, once, for one more
// Store (see release).
func (h *stepsHandle) open(ctx context.Context, file string, drv driver.Driver, create bool) (*sql.DB, error) {
	h.once.Lock()
	defer h.once.Unlock()
	if h.db != nil {
		h.refs++
		return h.db, nil
	}
	c := &stepsConnector{drv: drv}
	if file == "" {
		c.dsn = ":memory:"
	} else {
		h.path = file + StepsFileSuffix
		if _, err := os.Stat(h.path); errors.Is(err, fs.ErrNotExist) && !create {
			return nil, nil
		}
		// A URI filename without parameters: SQLite drivers open it as a file,
		// and none reads options of its own out of a '?' in the path.
		c.dsn = "file:" + escapeURIPath(h.path)
		c.setup = []string{
			"PRAGMA busy_timeout = " + fmt.Sprint(DefaultLockTimeout.Milliseconds()),
			"PRAGMA journal_mode = WAL",
			// A step's record is what keeps the other service from being
			// called twice: its commit is flushed before the step returns.
			"PRAGMA synchronous = FULL",
		}
	}
	sdb := sql.OpenDB(c)
	if file == "" {
		// One connection, never closed: the in-memory database lives as long
		// as it does.
		sdb.SetMaxOpenConns(1)
	} else {
		sdb.SetMaxOpenConns(4)
	}
	sdb.SetMaxIdleConns(4)
	sdb.SetConnMaxLifetime(0)
	sdb.SetConnMaxIdleTime(0)
	if err := sdb.PingContext(ctx); err != nil {
		_ = sdb.Close()
		return nil, wrap("steps: open "+c.dsn, err)
	}
	h.db, h.refs = sdb, 1
	return sdb, nil
}

// release is a Store's Close of the steps database open gave it: the last
// Store closes a steps file (a Store used again opens it again). An
// in-memory steps database stays open, as long as its records database: its
// step records live nowhere else.
func (h *stepsHandle) release() error {
	h.once.Lock()
	defer h.once.Unlock()
	if h.refs--; h.refs > 0 || h.db == nil || h.path == "" {
		return nil
	}
	sdb := h.db
	h.db, h.refs = nil, 0
	return sdb.Close()
}

// closeSteps is Close for the steps database: the Store lets go of the
// shared handle (Config.StepsDB is the caller's, left open).
func (s *Store) closeSteps() error {
	st := &s.st
	st.mu.Lock()
	defer st.mu.Unlock()
	h := st.handle
	if h == nil {
		return nil
	}
	st.db, st.gate, st.ready, st.handle = nil, nil, false, nil
	return h.release()
}

// escapeURIPath escapes the characters that would end or change the path part
// of a SQLite URI filename.
func escapeURIPath(p string) string {
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		switch c := p[i]; c {
		case '%', '?', '#':
			fmt.Fprintf(&b, "%%%02X", c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// stepsConnector opens connections to the steps database with the driver of
// the records' database, and sets each up with setup's statements.
type stepsConnector struct {
	drv   driver.Driver
	dsn   string
	setup []string
}

func (c *stepsConnector) Driver() driver.Driver { return c.drv }

func (c *stepsConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	for _, q := range c.setup {
		// Turning a new file to WAL takes an exclusive lock SQLite does not
		// wait for: retry while another process holds the file.
		deadline := time.Now().Add(DefaultLockTimeout)
		for {
			err = execDriver(ctx, conn, q)
			if err == nil || !isLockErr(err) || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			_ = conn.Close()
			return nil, fmt.Errorf("%s: %w", q, err)
		}
	}
	return conn, nil
}

func isLockErr(err error) bool {
	m := strings.ToLower(err.Error())
	return strings.Contains(m, "busy") || strings.Contains(m, "locked")
}

// execDriver runs q on a driver connection.
func execDriver(ctx context.Context, conn driver.Conn, q string) error {
	if e, ok := conn.(driver.ExecerContext); ok {
		_, err := e.ExecContext(ctx, q, nil)
		if !errors.Is(err, driver.ErrSkip) {
			return err
		}
	}
	st, err := conn.Prepare(q)
	if err != nil {
		return err
	}
	defer st.Close()
	if sc, ok := st.(driver.StmtExecContext); ok {
		_, err = sc.ExecContext(ctx, nil)
		return err
	}
	return fmt.Errorf("the SQLite driver %T runs no statement without arguments through database/sql/driver's context interfaces", conn)
}

// stepNonce returns a fresh nonce for the attempt column.
func stepNonce() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// maxStepText bounds an owner token and a derived key.
const maxStepText = 1024

// checkStep refuses what no caller may pass: empty or overlong names, NUL
// bytes in the text columns.
func checkStep(name, owner string) error {
	if name == "" {
		return errors.New("sqlitestore: the step name is empty; name every step")
	}
	if err := idem.CheckFieldSize("sqlitestore", "step name", int64(len(name)), idem.MaxStepNameLength); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("sqlitestore", "step owner", int64(len(owner)), maxStepText); err != nil {
		return err
	}
	if strings.IndexByte(name, 0) >= 0 || strings.IndexByte(owner, 0) >= 0 {
		return errors.New("sqlitestore: a step name or owner contains a NUL byte; use visible ASCII")
	}
	return nil
}

func checkResult(result []byte) ([]byte, error) {
	if err := idem.CheckFieldSize("sqlitestore", "step result", int64(len(result)), maxValue); err != nil {
		return nil, err
	}
	if result == nil {
		result = []byte{}
	}
	return result, nil
}

// BeginStep implements idem.StepStore with one INSERT … ON CONFLICT DO UPDATE
// … RETURNING on the step records' database, under its gate. With
// req.Holder, the request record is read first, from the records' database,
// inside a transaction of the steps database that holds its write lock, so
// that no other step operation comes between the check and the write.
func (s *Store) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	if err := checkStep(req.Name, req.Owner); err != nil {
		return nil, false, err
	}
	if req.DerivedKey == "" || strings.IndexByte(req.DerivedKey, 0) >= 0 {
		return nil, false, errors.New("sqlitestore: begin step: the derived key is empty or contains a NUL byte")
	}
	if err := idem.CheckFieldSize("sqlitestore", "step derived key", int64(len(req.DerivedKey)), maxStepText); err != nil {
		return nil, false, err
	}
	db, g, err := s.steps(ctx, true)
	if err != nil {
		return nil, false, err
	}
	if rec, ok, err := s.peekStep(ctx, db, req); err != nil || ok {
		return rec, false, err
	}
	// The Holder fence must hold from its check until the step's commit: a
	// takeover of the request record committed in between (the fence passed,
	// the record taken over, a reader of the steps seeing no step, the old
	// holder's step appearing after) would not be linearizable. A takeover is
	// a write of the records file: inside the handler's transaction (Tx in
	// ctx), which holds that file's write lock, none can happen, and the
	// check reads through that transaction (the pool may have no other
	// connection to give while it holds one); otherwise the
	// check runs in a transaction of the records file that takes its write
	// lock and keeps it until the step has committed (the records' gate, then
	// the steps', always in that order).
	var fence recordsReader = s.records(ctx)
	if req.Holder && fence == recordsReader(s.db) {
		unlockMain, err := s.gate.lock(ctx, s.lockTimeout)
		if err != nil {
			return nil, false, wrap("begin step", err)
		}
		defer unlockMain()
		mtx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return nil, false, wrap("begin step: begin on the records' database", err)
		}
		defer func() { _ = mtx.Rollback() }()
		if _, err := mtx.ExecContext(ctx, s.q[stmtLock]); err != nil {
			return nil, false, wrap("begin step: take the records' write lock", err)
		}
		fence = mtx
	}
	unlock, err := g.lock(ctx, s.lockTimeout)
	if err != nil {
		return nil, false, wrap("begin step", err)
	}
	defer unlock()
	type queryer interface {
		QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	}
	var q queryer = db
	var tx *sql.Tx
	if req.Holder {
		if tx, err = db.BeginTx(ctx, nil); err != nil {
			return nil, false, wrap("begin step", err)
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, s.st.q.lock); err != nil {
			return nil, false, wrap("begin step: take the steps' write lock", err)
		}
		held, err := s.holds(ctx, fence, req)
		if err != nil {
			return nil, false, err
		}
		if !held {
			return nil, false, idem.ErrLockLost
		}
		q = tx
	}
	rec := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name}
	var began bool
	var state, started, expires int64
	var result []byte
	first := req.First && req.Fingerprint != ""
	begin := s.st.q.begin
	if first {
		begin = s.st.q.beginFirst
	}
	err = q.QueryRowContext(ctx, begin, req.Scope, req.Key, req.Name, req.Owner, req.DerivedKey,
		nanos(req.Now), nanos(req.ExpiresAt), stepNonce(), req.Rerun, req.Fingerprint).
		Scan(&began, &state, &rec.Owner, &rec.DerivedKey, &result, &started, &expires, &rec.Fingerprint)
	if first && errors.Is(err, sql.ErrNoRows) {
		// Another request's row of the key lives: nothing written.
		o, err := s.otherStep(ctx, q, req)
		if err == nil && o == nil {
			err = errors.New("sqlitestore: begin step: the step was neither begun nor refused as another request's; retry")
		}
		return o, false, err
	}
	if err != nil {
		return nil, false, wrap("begin step", err)
	}
	if tx != nil {
		if err := tx.Commit(); err != nil {
			return nil, false, wrap("begin step: commit", err)
		}
	}
	rec.State, rec.Result = idem.StepState(state), result
	rec.StartedAt, rec.ExpiresAt = fromNanos(started), fromNanos(expires)
	if started == nanos(req.Now) {
		rec.StartedAt = req.Now
	}
	if expires == nanos(req.ExpiresAt) {
		rec.ExpiresAt = req.ExpiresAt
	}
	return rec, began, nil
}

// holds reports whether the request record of req is in flight under
// req.Owner and live at req.Now: a read of the records file through q (the
// *sql.DB: in WAL mode it waits for no writer; or a transaction of it).
func (s *Store) holds(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}, req idem.BeginStepRequest) (bool, error) {
	var held int
	err := q.QueryRowContext(ctx, `SELECT 1 FROM `+quoteIdent(s.table)+` WHERE scope = ? AND key = ? AND state = 1 AND token = ? AND expires_at > ?`,
		req.Scope, req.Key, req.Owner, nanos(req.Now)).Scan(&held)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, recordsErr("begin step: read the request record", err)
	}
	return true, nil
}

// recordsErr wraps the error of a read of the records' database for op. A
// read through the request's transaction (records) that the handler ended
// itself fails with sql.ErrTxDone: that says so, and what to do.
func recordsErr(op string, err error) error {
	if errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("sqlitestore: %s: the request's transaction (sqlitestore.Tx) was committed or rolled back by the handler; idem ends it when the handler returns, so never call Commit or Rollback on it (use SAVEPOINT and ROLLBACK TO for a partial rollback): %w", op, err)
	}
	return wrap(op, err)
}

// peekStep decides BeginStep without a write, the gate or a lock when it can:
// a live record req may not take and whose expiry req would not move (a
// replay of a done step, above all) is the answer, ok true. The step is read
// first, then (with Holder) the request record: a record held by req.Owner
// when read was held from its claim on, so at the step's reading too, and
// both hold at that instant.
func (s *Store) peekStep(ctx context.Context, db *sql.DB, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	rec := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name}
	var state, started, expires int64
	err := db.QueryRowContext(ctx, s.st.q.peek, req.Scope, req.Key, req.Name).
		Scan(&state, &rec.Owner, &rec.DerivedKey, &rec.Result, &started, &expires, &rec.Fingerprint)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, wrap("begin step: read the step", err)
	}
	rec.State = idem.StepState(state)
	other := rec.Fingerprint != "" && req.Fingerprint != "" && rec.Fingerprint != req.Fingerprint
	takeable := rec.State == idem.StepStarted && (rec.Owner == "" || (req.Rerun && rec.Owner != req.Owner))
	if expires <= nanos(req.Now) || (!other && (takeable || nanos(req.ExpiresAt) > expires)) {
		return nil, false, nil
	}
	if !other && req.First && req.Fingerprint != "" {
		// The answer without a write, unless another request's row of the
		// key lives: read in the same way, before the request record.
		o, err := s.otherStep(ctx, db, req)
		if err != nil {
			return nil, false, err
		}
		if o != nil {
			rec, other = o, true
			started, expires = nanos(o.StartedAt), nanos(o.ExpiresAt)
		}
	}
	if req.Holder {
		held, err := s.holds(ctx, s.records(ctx), req)
		if err != nil {
			return nil, false, err
		}
		if !held {
			return nil, false, idem.ErrLockLost
		}
	}
	rec.StartedAt, rec.ExpiresAt = fromNanos(started), fromNanos(expires)
	if expires == nanos(req.ExpiresAt) && !other {
		rec.ExpiresAt = req.ExpiresAt
	}
	return rec, true, nil
}

// otherStep returns a live step record of req's key, of any name, of another
// request than req's fingerprint, or nil; read through q.
func (s *Store) otherStep(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}, req idem.BeginStepRequest) (*idem.StepRecord, error) {
	rec := &idem.StepRecord{Scope: req.Scope, Key: req.Key}
	var state, started, expires int64
	err := q.QueryRowContext(ctx, s.st.q.other, req.Scope, req.Key, nanos(req.Now), req.Fingerprint).
		Scan(&rec.Name, &state, &rec.Owner, &rec.DerivedKey, &rec.Result, &started, &expires, &rec.Fingerprint)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, wrap("begin step: read the key's steps", err)
	}
	rec.State = idem.StepState(state)
	rec.StartedAt, rec.ExpiresAt = fromNanos(started), fromNanos(expires)
	return rec, nil
}

// recordsReader reads the records' database.
type recordsReader interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// records returns what reads the records' database for a call with ctx: the
// open transaction of a Store on the store's *sql.DB that ctx carries
// (BeginTx, BeginLocked), or else the *sql.DB. That transaction holds the
// records file's write lock, so no request record of that file can change
// until it ends. A read of the
// *sql.DB beside that transaction would need a second connection, and wait
// for ever for one on a pool of one (SetMaxOpenConns(1)): the transaction
// holds it until the handler returns (TestOneConnectionPoolSteps). Inside
// it the read sees what another connection would, but for the
// transaction's own writes: it holds the write lock.
func (s *Store) records(ctx context.Context) recordsReader {
	if t, _ := ctx.Value(txKey{}).(*storeTx); t != nil && t.s.db == s.db && !t.ended.Load() {
		return t.tx
	}
	return s.db
}

// stepExec runs one write statement on the step records' database under its
// gate and returns how many rows it changed.
func (s *Store) stepExec(ctx context.Context, op, q string, args ...any) (int64, error) {
	db, g, err := s.steps(ctx, true)
	if err != nil {
		return 0, err
	}
	unlock, err := g.lock(ctx, s.lockTimeout)
	if err != nil {
		return 0, wrap(op, err)
	}
	defer unlock()
	res, err := db.ExecContext(ctx, q, args...)
	if err != nil {
		return 0, wrap(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, wrap(op, err)
	}
	return n, nil
}

// FinishStep implements idem.StepStore: one fenced UPDATE.
func (s *Store) FinishStep(ctx context.Context, scope, key, name, owner string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(name, owner); err != nil {
		return err
	}
	if state != idem.StepDone && state != idem.StepFailed {
		return fmt.Errorf("sqlitestore: finish step: state %v; a step finishes done or failed", state)
	}
	result, err := checkResult(result)
	if err != nil {
		return err
	}
	n, err := s.stepExec(ctx, "finish step", s.st.q.finish, int64(state), result, scope, key, name, nanos(now), owner)
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// AbandonStep implements idem.StepStore: one fenced UPDATE.
func (s *Store) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	if err := checkStep(name, owner); err != nil {
		return err
	}
	n, err := s.stepExec(ctx, "abandon step", s.st.q.abandon, scope, key, name, nanos(now), owner)
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// GetSteps implements idem.StepStore. It reads without the write lock.
func (s *Store) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	db, _, err := s.steps(ctx, false)
	if err != nil || db == nil {
		return nil, err
	}
	rows, err := db.QueryContext(ctx, s.st.q.get, scope, key, nanos(now))
	if err != nil {
		return nil, wrap("get steps", err)
	}
	defer rows.Close()
	var out []idem.StepRecord
	for rows.Next() {
		rec := idem.StepRecord{Scope: scope, Key: key}
		var state, started, expires int64
		if err := rows.Scan(&rec.Name, &state, &rec.Owner, &rec.DerivedKey, &rec.Result, &started, &expires, &rec.Fingerprint); err != nil {
			return nil, wrap("get steps", err)
		}
		rec.State, rec.StartedAt, rec.ExpiresAt = idem.StepState(state), fromNanos(started), fromNanos(expires)
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, wrap("get steps", err)
	}
	return out, nil
}

// SettleStep implements idem.StepStore: one UPDATE, or one DELETE for state 0.
func (s *Store) SettleStep(ctx context.Context, scope, key, name string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(name, ""); err != nil {
		return err
	}
	q, args := s.st.q.forget, []any{scope, key, name, nanos(now)}
	switch state {
	case 0:
	case idem.StepDone, idem.StepFailed:
		var err error
		if result, err = checkResult(result); err != nil {
			return err
		}
		q, args = s.st.q.settle, append([]any{int64(state), result}, args...)
	default:
		return fmt.Errorf("sqlitestore: settle step: state %v; settle a step as done or failed, or 0 to forget it", state)
	}
	db, _, err := s.steps(ctx, false)
	if err != nil {
		return err
	}
	if db == nil {
		return idem.ErrNotFound
	}
	n, err := s.stepExec(ctx, "settle step", q, args...)
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrNotFound
	}
	return nil
}

// DeleteExpiredSteps implements idem.StepStore with one bounded DELETE on the
// step records' database (none when no step was ever recorded).
func (s *Store) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	db, _, err := s.steps(ctx, false)
	if err != nil || db == nil {
		return 0, err
	}
	n, err := s.stepExec(ctx, "delete expired steps", s.st.q.deleteExpired, nanos(now), limit)
	return int(n), err
}
