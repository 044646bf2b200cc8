package sqlitestore

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/headerjson"
	"github.com/idemkit/idem/internal/unixnano"
)

// DefaultTable is the table Config.Table defaults to.
const DefaultTable = "idem_records"

// DefaultLockTimeout is the value Config.LockTimeout defaults to: the busy
// timeout embedded.Open sets.
const DefaultLockTimeout = 10 * time.Second

// Config configures a Store. A nil *Config means all defaults. New copies it; the
// caller's struct is never modified.
type Config struct {
	// Table is the name of the records table: a letter or underscore followed by
	// up to 62 letters, digits or underscores. Several stores can share one
	// database with different tables. Defaults to "idem_records".
	Table string

	// LockTimeout bounds how long a store call waits, inside this process, for the
	// write lock held by another idem transaction on the same *sql.DB (see
	// "One writer" in the package documentation) before it fails. Waiting for
	// another process's lock is bounded by the driver's busy timeout instead.
	// Defaults to 10 seconds.
	LockTimeout time.Duration

	// StepsDB, when set, is the database step records (idem.Step) are kept
	// in, instead of the file sqlitestore opens beside the records' file (see
	// "Step records" in the package documentation). It must be another file:
	// the handler's transaction holds the records file's write lock.
	StepsDB *sql.DB
}

var tableName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Store is an idem.Store, idem.TxStore and idem.SingleTxStore on a SQLite
// database. Make one with New.
// It is safe for concurrent use, also by several processes on one database file.
type Store struct {
	db          *sql.DB
	table       string // bare name
	gate        gate
	lockTimeout time.Duration
	q           queries

	mu       sync.Mutex // guards preparing
	prepared [numStmts]atomic.Pointer[sql.Stmt]
	warmed   atomic.Bool // every statement is prepared (warm)
	busy     *busyKeys   // shared by the Stores on db
	st       stepsState  // the step records' database (steps.go)

	sweepMu sync.Mutex  // serializes DeleteExpired
	sweep   sweepCursor // where the last DeleteExpired stopped
}

var (
	_ idem.Store   = (*Store)(nil)
	_ idem.TxStore = (*Store)(nil)
)

// New returns a Store that keeps records in db, which must be a SQLite database
// opened by a driver the application registered (embedded.Open opens one with
// modernc.org/sqlite, set up as this package expects). New does not touch the
// database: call Migrate once at start-up (or run `idem migrate`) to create the
// table.
func New(db *sql.DB, cfg *Config) (*Store, error) {
	if db == nil {
		return nil, errors.New("sqlitestore: db is nil; pass a *sql.DB for a SQLite file, for example from embedded.Open(\"idem.db\")")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if !tableName.MatchString(c.Table) {
		return nil, fmt.Errorf("sqlitestore: Config.Table %q is not a plain identifier; use a letter or underscore followed by at most 62 letters, digits or underscores, for example %q", c.Table, DefaultTable)
	}
	switch {
	case c.LockTimeout == 0:
		c.LockTimeout = DefaultLockTimeout
	case c.LockTimeout < 0:
		return nil, fmt.Errorf("sqlitestore: Config.LockTimeout is %v; use a positive duration, or 0 for the default %v", c.LockTimeout, DefaultLockTimeout)
	}
	sh := sharedFor(db)
	return &Store{
		db:          db,
		table:       c.Table,
		gate:        sh.gate,
		busy:        &sh.busy,
		lockTimeout: c.LockTimeout,
		q:           newQueries(quoteIdent(c.Table)),
		st:          stepsState{cfg: c.StepsDB, q: newStepQueries(c.Table)},
	}, nil
}

// Table returns the name of the records table.
func (s *Store) Table() string { return s.table }

// DB returns the database the store was made with.
func (s *Store) DB() *sql.DB { return s.db }

func quoteIdent(name string) string { return `"` + strings.ReplaceAll(name, `"`, `""`) + `"` }

// queries are the statements of one table, indexed by stmtID.
type queries [numStmts]string

// stmtID names a statement of queries.
type stmtID int

const (
	stmtGet stmtID = iota
	stmtGetLive
	stmtClaim
	stmtComplete
	stmtRelease
	stmtExtend
	stmtExpiredFrom
	stmtExpiredAll
	stmtDeleteRange
	stmtDeleteUpTo
	stmtLock
	stmtLockLive
	stmtInsert
	numStmts
)

const columns = `state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref`

func newQueries(t string) queries {
	return queries{
		stmtGet:     `SELECT ` + columns + ` FROM ` + t + ` WHERE scope = ? AND key = ?`,
		stmtGetLive: `SELECT ` + columns + ` FROM ` + t + ` WHERE scope = ? AND key = ? AND expires_at > ?`,
		stmtClaim: `INSERT INTO ` + t + ` AS r (scope, key, state, fingerprint, token, created_at, lease_until, expires_at)
VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, ?7)
ON CONFLICT (scope, key) DO UPDATE SET
    state = 1,
    fingerprint = excluded.fingerprint,
    token = excluded.token,
    created_at = CASE WHEN r.expires_at <= ?5 THEN excluded.created_at ELSE r.created_at END,
    lease_until = excluded.lease_until,
    expires_at = excluded.expires_at,
    status = NULL, headers = NULL, body = NULL, body_omitted = 0, ref = NULL
WHERE r.expires_at <= ?5
   OR (r.state = 1 AND r.lease_until <= ?5 AND r.fingerprint = excluded.fingerprint)
RETURNING created_at`,
		stmtComplete: `UPDATE ` + t + ` SET state = 2, expires_at = ?, status = ?, headers = ?, body = ?, body_omitted = ?, ref = ?
WHERE scope = ? AND key = ? AND token = ? AND state = 1`,
		stmtRelease: `DELETE FROM ` + t + ` WHERE scope = ? AND key = ? AND token = ? AND state = 1`,
		stmtExtend:  `UPDATE ` + t + ` SET lease_until = ?1, expires_at = MAX(expires_at, ?1) WHERE scope = ? AND key = ? AND token = ? AND state = 1`,
		// The janitor's read, outside the write lock: the next expired keys in
		// primary key order, after a cursor (From) or from the start (All).
		stmtExpiredFrom: `SELECT scope, key FROM ` + t + ` WHERE (scope, key) > (?1, ?2) AND expires_at <= ?3 ORDER BY scope, key LIMIT ?4`,
		stmtExpiredAll:  `SELECT scope, key FROM ` + t + ` WHERE expires_at <= ?1 ORDER BY scope, key LIMIT ?2`,
		// The janitor's delete, under the write lock: the expired records of a key
		// range the read found, a bounded range scan of the primary key.
		stmtDeleteRange: `DELETE FROM ` + t + ` WHERE (scope, key) IN (SELECT scope, key FROM ` + t + ` WHERE (scope, key) > (?1, ?2) AND (scope, key) <= (?3, ?4) AND expires_at <= ?5 ORDER BY scope, key LIMIT ?6)`,
		stmtDeleteUpTo:  `DELETE FROM ` + t + ` WHERE (scope, key) IN (SELECT scope, key FROM ` + t + ` WHERE (scope, key) <= (?1, ?2) AND expires_at <= ?3 ORDER BY scope, key LIMIT ?4)`,
		stmtInsert: `INSERT INTO ` + t + ` AS r (scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (scope, key) DO UPDATE SET
    state = excluded.state, fingerprint = excluded.fingerprint, token = excluded.token,
    created_at = excluded.created_at, lease_until = excluded.lease_until, expires_at = excluded.expires_at,
    status = excluded.status, headers = excluded.headers, body = excluded.body,
    body_omitted = excluded.body_omitted, ref = excluded.ref
WHERE r.expires_at <= ?`, // anonymous parameters: modernc.org/sqlite allocates the name of each ?NNN per execution
		// A write statement that changes nothing: run first in a transaction, it
		// takes the write lock whatever BEGIN mode the driver uses.
		stmtLock: `UPDATE ` + t + ` SET state = state WHERE 0`,
		// The same for BeginLocked: it takes the write lock and counts the live
		// records of (scope, key) in one statement, changing nothing.
		stmtLockLive: `UPDATE ` + t + ` SET state = state WHERE scope = ? AND key = ? AND expires_at > ?`,
	}
}

// row is a record as stored.
type row struct {
	state                          int64
	fingerprint, token             string
	createdAt, leaseUntil, expires int64
	status                         sql.NullInt64
	headers                        sql.NullString
	body                           []byte
	bodyOmitted                    bool
	ref                            sql.NullString
}

// stmt returns statement id, prepared once per Store (and by database/sql once
// per connection); within tx when tx is not nil.
//
// Within tx a statement the Store has not prepared (Close released it while
// tx was open) is prepared on tx's own connection: preparing on the pool
// needs a second connection, which a pool of one never gives while tx holds
// its only one (TestTxAfterCloseOneConnection).
func (s *Store) stmt(ctx context.Context, id stmtID, tx *sql.Tx) (*sql.Stmt, error) {
	st := s.prepared[id].Load()
	if st == nil && tx != nil {
		return tx.PrepareContext(ctx, s.q[id])
	}
	if st == nil {
		s.mu.Lock()
		defer s.mu.Unlock()
		if st = s.prepared[id].Load(); st == nil {
			var err error
			st, err = s.db.PrepareContext(ctx, s.q[id])
			if err != nil {
				if strings.Contains(err.Error(), "no such table") {
					return nil, fmt.Errorf("%w; create it with Store.Migrate or `idem migrate` first", err)
				}
				return nil, err
			}
			s.prepared[id].Store(st)
		}
	}
	if tx != nil {
		return tx.StmtContext(ctx, st), nil
	}
	return st, nil
}

// warm prepares every statement before a transaction takes its connection.
// Preparing on the pool needs a connection of its own: a transaction whose
// first use of a statement prepared it waited for a second connection, for
// ever when the pool has one (sql.DB.SetMaxOpenConns(1), common with SQLite;
// TestOneConnectionPool).
func (s *Store) warm(ctx context.Context) error {
	if s.warmed.Load() {
		return nil
	}
	for id := range stmtID(numStmts) {
		if _, err := s.stmt(ctx, id, nil); err != nil {
			return err
		}
	}
	s.warmed.Store(true)
	return nil
}

// Close releases the store's prepared statements and its step records'
// database: the steps file beside the records' is closed when the last Store
// on the *sql.DB that recorded steps is closed. It does not close the *sql.DB,
// nor Config.StepsDB. Call it after the last use of the store; a store used
// again prepares its statements, and opens the steps file, again.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	s.warmed.Store(false)
	for i := range s.prepared {
		if st := s.prepared[i].Swap(nil); st != nil {
			errs = append(errs, st.Close())
		}
	}
	errs = append(errs, s.closeSteps())
	return errors.Join(errs...)
}

// read returns the stored row for (scope, key), or nil when there is none. With
// live, rows expired at now count as absent.
//
// The read keeps ctx's cancellation, although in WAL mode it waits for no writer
// and modernc.org/sqlite starts a goroutine watching ctx during the statement:
// without it, 8 in-process clients on GOMAXPROCS=1 spent more CPU, not less
// (the runtime's sysmon thread stayed at its 20 µs period, retaking the P from
// syscalls ~6 times per request, and reads spread over more pool connections,
// each re-reading pages another connection's commit had invalidated).
func (s *Store) read(ctx context.Context, scope, key string, live bool, now int64) (*row, error) {
	var sr *sql.Row
	if live {
		st, err := s.stmt(ctx, stmtGetLive, nil)
		if err != nil {
			return nil, err
		}
		sr = st.QueryRowContext(ctx, scope, key, now)
	} else {
		st, err := s.stmt(ctx, stmtGet, nil)
		if err != nil {
			return nil, err
		}
		sr = st.QueryRowContext(ctx, scope, key)
	}
	return scanRow(sr)
}

// scanRow scans a row selected with columns; nil when there is none.
func scanRow(sr *sql.Row) (*row, error) {
	var r row
	err := sr.Scan(&r.state, &r.fingerprint, &r.token, &r.createdAt, &r.leaseUntil, &r.expires, &r.status, &r.headers, &r.body, &r.bodyOmitted, &r.ref)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &r, nil
}

// claimable reports whether req may replace r (docs/design.md §1, idem.Store.Claim).
func (r *row) claimable(req *idem.ClaimRequest, now int64) bool {
	if r.expires <= now {
		return true
	}
	return r.state == int64(idem.StateInFlight) && r.leaseUntil <= now && r.fingerprint == req.Fingerprint
}

func (r *row) record(scope, key string) (*idem.Record, error) {
	rec := &idem.Record{
		Scope: scope, Key: key, State: idem.State(r.state), Fingerprint: r.fingerprint, Token: r.token,
		CreatedAt: fromNanos(r.createdAt), LeaseUntil: fromNanos(r.leaseUntil), ExpiresAt: fromNanos(r.expires),
	}
	if rec.State != idem.StateComplete {
		return rec, nil
	}
	resp := &idem.Response{Status: int(r.status.Int64), Body: r.body, BodyOmitted: r.bodyOmitted, Ref: r.ref.String}
	if r.headers.Valid {
		h, err := decodeHeaders(r.headers.String)
		if err != nil {
			return nil, fmt.Errorf("sqlitestore: the stored headers of (%q, %q) cannot be decoded (%w); the row was changed outside idem", scope, key, err)
		}
		resp.Header = h
	}
	rec.Response = resp
	return rec, nil
}

// Times are stored as integer Unix nanoseconds.
// nanos is t in Unix nanoseconds, saturated at the ends of int64 (years 1677
// and 2262): a TTL of centuries must keep its record, not wrap around into the
// past and expire it at once.
func nanos(t time.Time) int64 { return unixnano.Of(t) }

func fromNanos(n int64) time.Time     { return time.Unix(0, n) }
func wrap(op string, err error) error { return fmt.Errorf("sqlitestore: %s: %w", op, err) }

// maxClaimAttempts bounds the retries of a claim whose record changed between
// the claim statement and the read of the record (only another process, or a
// store on another *sql.DB, can do that).
const maxClaimAttempts = 10

// Claim implements idem.Store. A read decides first, without the write lock, when
// the existing record cannot be claimed (complete, or in flight under a live
// lease or another fingerprint); otherwise the one INSERT … ON CONFLICT DO UPDATE
// … WHERE … RETURNING statement decides.
func (s *Store) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if err := idem.CheckFieldSize("sqlitestore", "fingerprint", int64(len(req.Fingerprint)), maxValue); err != nil {
		return nil, false, err
	}
	now := nanos(req.Now)
	r, err := s.read(ctx, req.Scope, req.Key, false, 0)
	if err != nil {
		return nil, false, wrap("claim: read record", err)
	}
	if r != nil && !r.claimable(&req, now) {
		rec, err := r.record(req.Scope, req.Key)
		return rec, false, err
	}
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return nil, false, wrap("claim", err)
	}
	defer unlock()
	claim, err := s.stmt(ctx, stmtClaim, nil)
	if err != nil {
		return nil, false, wrap("claim", err)
	}
	for range maxClaimAttempts {
		var created int64
		err := claim.QueryRowContext(ctx, req.Scope, req.Key, req.Fingerprint, req.Token,
			now, nanos(req.LeaseUntil), nanos(req.ExpiresAt)).Scan(&created)
		if err == nil {
			return &idem.Record{
				Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
				Token: req.Token, CreatedAt: fromNanos(created), LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt,
			}, true, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return nil, false, wrap("claim", err)
		}
		// The record exists and may not be claimed: read it. It can have changed
		// since (another process released, completed or deleted it); then decide
		// again.
		r, err := s.read(ctx, req.Scope, req.Key, false, 0)
		if err != nil {
			return nil, false, wrap("claim: read record", err)
		}
		if r != nil && !r.claimable(&req, now) {
			rec, err := r.record(req.Scope, req.Key)
			return rec, false, err
		}
	}
	return nil, false, fmt.Errorf("sqlitestore: claim (%q, %q): the record changed under %d claim attempts in a row; another process is rewriting it, retry later", req.Scope, req.Key, maxClaimAttempts)
}

// fenced runs compare-and-set statement id, within tx when it is not nil, and
// turns "no row matched" into ErrLockLost.
func (s *Store) fenced(ctx context.Context, tx *sql.Tx, op string, id stmtID, args ...any) error {
	st, err := s.stmt(ctx, id, tx)
	if err != nil {
		return wrap(op, err)
	}
	res, err := st.ExecContext(ctx, args...)
	if err != nil {
		return wrap(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return wrap(op, err)
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

var errNilResponse = errors.New("the response is nil; pass the outcome to store")

// maxValue is the most sqlitestore puts into one row: SQLite's default
// SQLITE_MAX_LENGTH (10^9 bytes) bounds a value and a whole row, less room
// for the other columns.
const maxValue = 1_000_000_000 - 1<<16

// checkFields refuses a response, with its headers encoded as headers, that a
// row cannot hold, with idem.ErrFieldTooLarge.
func checkFields(resp *idem.Response, headers int) error {
	for _, f := range [...]struct {
		name string
		size int
	}{{"headers", headers}, {"body", len(resp.Body)}, {"ref", len(resp.Ref)}} {
		if err := idem.CheckFieldSize("sqlitestore", f.name, int64(f.size), maxValue); err != nil {
			return err
		}
	}
	// The row as a whole, counted against the largest of its parts.
	return idem.CheckFieldSize("sqlitestore", "body", int64(headers+len(resp.Body)+len(resp.Ref)), maxValue)
}

// encodeResponse returns the headers, body and ref columns of resp.
func encodeResponse(resp *idem.Response) (headers sql.NullString, body []byte, ref sql.NullString, err error) {
	if len(resp.Header) > 0 {
		h, err := encodeHeaders(resp.Header)
		if err != nil {
			return headers, nil, ref, fmt.Errorf("encode headers: %w", err)
		}
		headers = sql.NullString{String: h, Valid: true}
	}
	if err := checkFields(resp, len(headers.String)); err != nil {
		return headers, nil, ref, err
	}
	if resp.Ref != "" {
		ref = sql.NullString{String: resp.Ref, Valid: true}
	}
	body = resp.Body
	if body == nil {
		body = []byte{}
	}
	return headers, body, ref, nil
}

func (s *Store) complete(ctx context.Context, tx *sql.Tx, scope, key, token string, resp *idem.Response, expiresAt time.Time) error {
	if resp == nil {
		return wrap("complete", errNilResponse)
	}
	headers, body, ref, err := encodeResponse(resp)
	if err != nil {
		return wrap("complete", err)
	}
	return s.fenced(ctx, tx, "complete", stmtComplete,
		nanos(expiresAt), int64(resp.Status), headers, body, resp.BodyOmitted, ref, scope, key, token)
}

// Complete implements idem.Store.
func (s *Store) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return wrap("complete", err)
	}
	defer unlock()
	return s.complete(ctx, nil, scope, key, token, resp, expiresAt)
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, scope, key, token string) error {
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return wrap("release", err)
	}
	defer unlock()
	return s.fenced(ctx, nil, "release", stmtRelease, scope, key, token)
}

// Extend implements idem.Store. It waits for the write lock like every write, so
// it cannot renew a lease while a transaction holds the lock (see "Leases and the
// one writer" in the package documentation).
func (s *Store) Extend(ctx context.Context, scope, key, token string, _, leaseUntil time.Time) error {
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return wrap("extend", err)
	}
	defer unlock()
	return s.fenced(ctx, nil, "extend", stmtExtend, nanos(leaseUntil), scope, key, token)
}

// Get implements idem.Store. It reads without the write lock.
func (s *Store) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	r, err := s.read(ctx, scope, key, true, nanos(now))
	if err != nil {
		return nil, wrap("get", err)
	}
	if r == nil {
		return nil, idem.ErrNotFound
	}
	return r.record(scope, key)
}

// DeleteExpired implements idem.Store. The table has no index on expires_at
// (every insert would have to write it), so expired records are found by a scan
// of the primary key, in two steps that keep the write lock short:
//
//	SELECT scope, key FROM idem_records                      -- no lock (WAL read)
//	WHERE (scope, key) > (?, ?) AND expires_at <= ?          -- from where the last call stopped
//	ORDER BY scope, key LIMIT ?
//
//	DELETE FROM idem_records WHERE (scope, key) IN (         -- under the write lock: a range
//	    SELECT scope, key FROM idem_records                  -- scan of the keys just read,
//	    WHERE (scope, key) > (?, ?) AND (scope, key) <= (?, ?)   -- re-checked at now
//	      AND expires_at <= ? ORDER BY scope, key LIMIT ?)
//
// The store remembers where a call stopped and the next one goes on from
// there, to the end of the table and then once from its start: a full sweep
// (Janitor, `idem gc`) reads the table once, and each batch holds the write
// lock only for the deletion of the keys it found.
func (s *Store) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("sqlitestore: DeleteExpired limit is %d; pass a positive batch size", limit)
	}
	s.sweepMu.Lock()
	defer s.sweepMu.Unlock()
	n := nanos(now)
	total := 0
	fromStart := !s.sweep.valid
	from := s.sweep
	for total < limit {
		want := limit - total
		keys, err := s.expiredKeys(ctx, from, n, want)
		if err != nil {
			return total, wrap("delete expired: find expired records", err)
		}
		if len(keys) > 0 {
			last := keys[len(keys)-1]
			d, err := s.deleteRange(ctx, from, last, n, want)
			total += d
			if err != nil {
				return total, wrap("delete expired", err)
			}
			from = sweepCursor{scope: last.scope, key: last.key, valid: true}
		}
		if len(keys) < want { // the end of the table
			if fromStart {
				s.sweep = sweepCursor{}
				return total, nil
			}
			fromStart, from = true, sweepCursor{}
		}
	}
	s.sweep = from
	return total, nil
}

// sweepCursor is the last key a DeleteExpired batch looked at; the zero value
// is the start of the table.
type sweepCursor struct {
	scope, key string
	valid      bool
}

// expiredKeys reads, without the write lock, up to limit keys expired at now
// after from, in primary key order.
func (s *Store) expiredKeys(ctx context.Context, from sweepCursor, now int64, limit int) ([]sweepCursor, error) {
	var rows *sql.Rows
	var err error
	if from.valid {
		st, serr := s.stmt(ctx, stmtExpiredFrom, nil)
		if serr != nil {
			return nil, serr
		}
		rows, err = st.QueryContext(ctx, from.scope, from.key, now, limit)
	} else {
		st, serr := s.stmt(ctx, stmtExpiredAll, nil)
		if serr != nil {
			return nil, serr
		}
		rows, err = st.QueryContext(ctx, now, limit)
	}
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	keys := make([]sweepCursor, 0, min(limit, 1024))
	for rows.Next() {
		var k sweepCursor
		if err := rows.Scan(&k.scope, &k.key); err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, rows.Err()
}

// deleteRange deletes, under the write lock, up to limit records expired at now
// in the key range (from, last].
func (s *Store) deleteRange(ctx context.Context, from, last sweepCursor, now int64, limit int) (int, error) {
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return 0, err
	}
	defer unlock()
	var res sql.Result
	if from.valid {
		st, serr := s.stmt(ctx, stmtDeleteRange, nil)
		if serr != nil {
			return 0, serr
		}
		res, err = st.ExecContext(ctx, from.scope, from.key, last.scope, last.key, now, limit)
	} else {
		st, serr := s.stmt(ctx, stmtDeleteUpTo, nil)
		if serr != nil {
			return 0, serr
		}
		res, err = st.ExecContext(ctx, last.scope, last.key, now, limit)
	}
	if err != nil {
		return 0, err
	}
	d, err := res.RowsAffected()
	return int(d), err
}

// binaryHeaders prefixes the stored headers when a value is not valid UTF-8:
// JSON would replace its bytes with U+FFFD, so the values are kept base64
// encoded instead. Headers that are all UTF-8 are stored as plain JSON, as
// they always were.
const binaryHeaders = "b64:"

// encodeHeaders returns the headers column for h.
func encodeHeaders(h http.Header) (string, error) {
	if headerjson.ValidUTF8(h) {
		b := headerjson.AppendHeaders(nil, h)
		return unsafe.String(unsafe.SliceData(b), len(b)), nil // b is not used again, as strings.Builder does
	}
	enc := make(map[string][]string, len(h))
	for k, vs := range h {
		ev := make([]string, len(vs))
		for i, v := range vs {
			ev[i] = base64.StdEncoding.EncodeToString([]byte(v))
		}
		enc[k] = ev
	}
	b, err := json.Marshal(enc)
	return binaryHeaders + string(b), err
}

// decodeHeaders reads a headers column written by encodeHeaders.
func decodeHeaders(col string) (http.Header, error) {
	var h http.Header
	if rest, ok := strings.CutPrefix(col, binaryHeaders); ok {
		if err := json.Unmarshal([]byte(rest), &h); err != nil {
			return nil, err
		}
		for _, vs := range h {
			for i, v := range vs {
				b, err := base64.StdEncoding.DecodeString(v)
				if err != nil {
					return nil, err
				}
				vs[i] = string(b)
			}
		}
		return h, nil
	}
	err := json.Unmarshal([]byte(col), &h)
	return h, err
}
