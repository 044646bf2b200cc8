package mysqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// DefaultTable is the table name used when Config.Table is empty.
const DefaultTable = "idem_records"

// Limits of the schema, checked before a value reaches the server (a server not in
// strict SQL mode would silently truncate an overlong value, and two keys that
// differ only after byte 255 would collide).
const (
	// MaxScopeLength is the longest scope stored, in bytes.
	MaxScopeLength = 255
	// MaxKeyLength is the longest idempotency key stored, in bytes. It matches
	// idem.DefaultMaxKeyLength; do not raise idem.Config.MaxKeyLength above it.
	MaxKeyLength = 255
	// MaxFingerprintLength is the longest request fingerprint stored, in bytes.
	MaxFingerprintLength = 512
	// MaxTokenLength is the longest lock token stored, in bytes.
	MaxTokenLength = 255
	// MaxHeadersLength is the longest encoding of the stored response headers
	// (a MEDIUMBLOB), in bytes.
	MaxHeadersLength = 1<<24 - 1
	// MaxBodyLength is the longest response body stored (a LONGBLOB), in bytes;
	// the server's max_allowed_packet is usually the lower bound.
	MaxBodyLength = 1<<32 - 1
	// MaxRefLength is the longest resource reference (idem.SetRef) stored (a
	// BLOB), in bytes.
	MaxRefLength = 1<<16 - 1
)

// maxTableLength leaves room for the "_migrations" suffix within MySQL's 64-character
// identifier limit.
const maxTableLength = 64 - len("_migrations")

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Config configures a Store. A nil *Config means all defaults. New copies it; the
// caller's struct is never modified.
type Config struct {
	// Table is the name of the records table, in the database the *sql.DB connects
	// to. It must be a plain identifier (letters, digits, underscore, not starting
	// with a digit, at most 53 characters); it is quoted with backticks. Migrate also
	// creates Table+"_migrations". Defaults to "idem_records".
	Table string
}

// Store is an idem.Store, idem.TxStore and idem.SingleTxStore on MySQL 8 or
// MariaDB 10.6 and later.
// Create it with New; it is safe for concurrent use.
type Store struct {
	db    *sql.DB
	table string // unquoted
	q     queries

	mu    sync.Mutex
	stmts map[string]*sql.Stmt

	// settings are read on first use (see settingsFor).
	settings atomic.Pointer[settings]

	// isolation is the isolation level of the transactions BeginTx and
	// BeginLocked open, decided on first use (see settingsFor): 0 not yet,
	// else a sql.IsolationLevel.
	isolation atomic.Int32

	noStepCAS   atomic.Bool // tests: BeginStep of an existing step always takes its transaction (steps.go)
	stepOwnConn atomic.Bool // tests: step statements always run on a connection of their own, as with the pool full (steps.go)
}

var (
	_ idem.Store   = (*Store)(nil)
	_ idem.TxStore = (*Store)(nil)
)

// New returns a Store that keeps records in cfg.Table through db. The caller opens
// db with the driver of its choice (github.com/go-sql-driver/mysql is the one
// tested); New registers no driver and does not touch the database. Run Migrate
// once (at deploy or start-up) before the store is used.
func New(db *sql.DB, cfg *Config) (*Store, error) {
	if db == nil {
		return nil, errors.New(`mysqlstore: db is nil; open one with sql.Open("mysql", dsn) (import _ "github.com/go-sql-driver/mysql") and pass it to New`)
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if !identRE.MatchString(c.Table) || len(c.Table) > maxTableLength {
		return nil, fmt.Errorf("mysqlstore: Config.Table %q is not a usable table name; use letters, digits and underscores, not starting with a digit, at most %d characters (the table lives in the DSN's database; a schema-qualified name is not accepted)", c.Table, maxTableLength)
	}
	return &Store{db: db, table: c.Table, q: newQueries(quote(c.Table)), stmts: map[string]*sql.Stmt{}}, nil
}

// Table returns the name of the records table.
func (s *Store) Table() string { return s.table }

// Close closes the prepared statements the store holds. It does not close the
// *sql.DB, which belongs to the caller.
func (s *Store) Close() error {
	s.mu.Lock()
	stmts := s.stmts
	s.stmts = map[string]*sql.Stmt{}
	s.mu.Unlock()
	// Outside s.mu: closing waits for each statement's connections to finish
	// what they run.
	var errs []error
	for _, st := range stmts {
		errs = append(errs, st.Close())
	}
	return errors.Join(errs...)
}

func quote(ident string) string { return "`" + ident + "`" }

// columns is the column list every read selects, in the order scanRecord expects.
const columns = "`scope`, `key`, `state`, `fingerprint`, `token`, `created_at`, `lease_until`, `expires_at`, `status`, `headers`, `body`, `body_omitted`, `ref`"

// claimCond is the claim condition on an existing row: expired, or in flight
// under a lapsed lease with the same fingerprint. Parameters: now, now, fingerprint.
const claimCond = "(`expires_at` <= ? OR (`state` = 1 AND `lease_until` <= ? AND `fingerprint` = ?))"

// claimOurs is true, in each assignment after the token's, exactly when the claim
// succeeded, whatever the server's assignment semantics (see the claim query).
// Parameters: token, now, now, fingerprint.
const claimOurs = "(`token` = ? OR " + claimCond + ")"

type queries struct {
	table                                                           string // quoted
	insertClaim                                                     string
	claim, claimRead, complete, release, extend, get, deleteExpired string
	lockedInsert                                                    string
}

func newQueries(t string) queries {
	return queries{
		table: t,
		// A claim of an absent key: the insert succeeds, or fails with a duplicate
		// key (1062) and changes nothing.
		insertClaim: "INSERT INTO " + t + " (`scope`, `key`, `state`, `fingerprint`, `token`, `created_at`, `lease_until`, `expires_at`) VALUES (?, ?, 1, ?, ?, ?, ?, ?)",
		// The claim is decided by this one statement (see the package doc). MySQL
		// applies ON DUPLICATE KEY UPDATE assignments left to right, each seeing the
		// columns already changed by the earlier ones; MariaDB does too, except under
		// sql_mode SIMULTANEOUS_ASSIGNMENT (part of sql_mode=ORACLE), where every
		// assignment sees the old row. The statement gives the same result either
		// way: the claim condition C reads expires_at, state, lease_until and
		// fingerprint, and every assignment asks "token = ours OR C". With the old
		// row in view, C is the decision itself (our token is fresh and random, so
		// it is never in the old row). Left to right, token is assigned first, from
		// C on the untouched row, so "token = ours" is true for every later
		// assignment exactly when the claim succeeds; when it fails nothing changes,
		// and C, read again on the unchanged row, stays false. created_at is
		// assigned before expires_at, so it tells a reclaimed expired record (new
		// created_at) from a taken-over lapsed lease (created_at kept) in both.
		claim: "INSERT INTO " + t + " (`scope`, `key`, `state`, `fingerprint`, `token`, `created_at`, `lease_until`, `expires_at`)" +
			" VALUES (?, ?, 1, ?, ?, ?, ?, ?)" +
			" ON DUPLICATE KEY UPDATE" +
			" `token` = IF(" + claimCond + ", ?, `token`)," +
			" `created_at` = IF(" + claimOurs + " AND `expires_at` <= ?, ?, `created_at`)," +
			" `state` = IF(" + claimOurs + ", 1, `state`)," +
			" `fingerprint` = IF(" + claimOurs + ", ?, `fingerprint`)," +
			" `lease_until` = IF(" + claimOurs + ", ?, `lease_until`)," +
			" `expires_at` = IF(" + claimOurs + ", ?, `expires_at`)," +
			" `renewals` = IF(" + claimOurs + ", 0, `renewals`)," +
			" `status` = IF(" + claimOurs + ", NULL, `status`)," +
			" `headers` = IF(" + claimOurs + ", NULL, `headers`)," +
			" `body` = IF(" + claimOurs + ", NULL, `body`)," +
			" `body_omitted` = IF(" + claimOurs + ", 0, `body_omitted`)," +
			" `ref` = IF(" + claimOurs + ", NULL, `ref`)",
		// Read back under the row lock the INSERT took; FOR UPDATE makes it a current
		// read whatever the isolation level.
		claimRead: "SELECT " + columns + " FROM " + t + " WHERE `scope` = ? AND `key` = ? FOR UPDATE",
		// state changes from 1 to 2, so a matched row is always a changed row and the
		// affected-rows count is right with or without clientFoundRows.
		complete: "UPDATE " + t + " SET `state` = 2, `status` = ?, `headers` = ?, `body` = ?, `body_omitted` = ?, `ref` = ?, `expires_at` = ?" +
			" WHERE `scope` = ? AND `key` = ? AND `token` = ? AND `state` = 1",
		release: "DELETE FROM " + t + " WHERE `scope` = ? AND `key` = ? AND `token` = ? AND `state` = 1",
		// renewals always changes, so extending to the same deadline twice still
		// counts as one affected row without clientFoundRows.
		extend: "UPDATE " + t + " SET `lease_until` = ?, `expires_at` = GREATEST(`expires_at`, ?), `renewals` = `renewals` + 1" +
			" WHERE `scope` = ? AND `key` = ? AND `token` = ? AND `state` = 1",
		get: "SELECT " + columns + " FROM " + t + " WHERE `scope` = ? AND `key` = ? AND `expires_at` > ?",
		// Ordering by the whole index entry (the secondary index carries the primary
		// key) makes the batch deterministic, which statement-based replication
		// requires of DELETE … LIMIT; it still reads the expires_at index in order.
		deleteExpired: "DELETE FROM " + t + " WHERE `expires_at` <= ? ORDER BY `expires_at`, `scope`, `key` LIMIT ?",
		// The single-transaction flow (single.go).
		lockedInsert: "INSERT INTO " + t + " (" + columns + ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
	}
}

// stmt returns the prepared statement for query, preparing it on first use. A
// failed preparation (for example before Migrate created the table) is not cached.
func (s *Store) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	s.mu.Lock()
	st := s.stmts[query]
	s.mu.Unlock()
	if st != nil {
		return st, nil
	}
	st, err := s.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, s.wrap(err)
	}
	return s.keep(query, st), nil
}

// keep stores st as the prepared statement for query and returns it, or,
// when another goroutine stored one first, returns that one and closes st in
// the background. Closing waits for the connection st was prepared on to
// finish its statement, which may be waiting for a row lock held by the
// caller's transaction, or by one whose goroutine waits for s.mu: closing
// under s.mu, or before returning, deadlocked concurrent BeginSteps until
// innodb_lock_wait_timeout (TestKeepNeverWaitsForABusyConnection).
func (s *Store) keep(query string, st *sql.Stmt) *sql.Stmt {
	s.mu.Lock()
	old := s.stmts[query]
	if old == nil {
		s.stmts[query] = st
	}
	s.mu.Unlock()
	if old != nil {
		go func() { _ = st.Close() }()
		return old
	}
	return st
}

// cached returns the prepared statement for query, or nil when it has not been
// prepared yet.
func (s *Store) cached(query string) *sql.Stmt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stmts[query]
}

// wrap adds advice to errors whose cause is known.
func (s *Store) wrap(err error) error {
	if err == nil {
		return nil
	}
	if code, ok := errorNumber(err); ok && code == 1146 { // ER_NO_SUCH_TABLE
		return fmt.Errorf("mysqlstore: table %s does not exist; run (*mysqlstore.Store).Migrate or `idem migrate` first: %w", quote(s.table), err)
	}
	return fmt.Errorf("mysqlstore: %w", err)
}

// errorNumber returns the server error number carried by err or any error it
// wraps. The store imports no driver (importing one would register it), so it
// recognises the number by shape: a Number() uint16 method, or an exported uint16
// field named Number, as go-sql-driver/mysql's *MySQLError has.
func errorNumber(err error) (uint16, bool) {
	for err != nil {
		if n, ok := err.(interface{ Number() uint16 }); ok {
			return n.Number(), true
		}
		v := reflect.ValueOf(err)
		for v.Kind() == reflect.Pointer && !v.IsNil() {
			v = v.Elem()
		}
		if v.Kind() == reflect.Struct {
			if f := v.FieldByName("Number"); f.IsValid() && f.Kind() == reflect.Uint16 {
				return uint16(f.Uint()), true
			}
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if n, ok := errorNumber(e); ok {
					return n, true
				}
			}
			return 0, false
		default:
			return 0, false
		}
	}
	return 0, false
}

// retryable reports whether err is a deadlock (1213), after which the server has
// rolled the transaction back and the statement can simply run again.
func retryable(err error) bool {
	code, ok := errorNumber(err)
	return ok && code == 1213
}

const maxAttempts = 30

// deadlocks counts the deadlocks retried, for tests.
var deadlocks atomic.Int64

// retry runs fn until it succeeds, fails with an error other than a deadlock, ctx
// ends, or maxAttempts deadlocks in a row happened.
func retry(ctx context.Context, fn func() error) error {
	for attempt := 1; ; attempt++ {
		err := fn()
		if err == nil || !retryable(err) || attempt == maxAttempts {
			return err
		}
		deadlocks.Add(1)
		// Back off a little, with jitter, so that the deadlocked claims do not meet again.
		d := time.Duration(attempt)*time.Millisecond + rand.N(2*time.Millisecond)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
}

func checkLengths(scope, key, fingerprint, token string) error {
	for _, f := range [...]struct {
		name        string
		size, limit int
	}{
		{"scope", len(scope), MaxScopeLength},
		{"key", len(key), MaxKeyLength},
		{"fingerprint", len(fingerprint), MaxFingerprintLength},
		{"token", len(token), MaxTokenLength},
	} {
		if err := idem.CheckFieldSize("mysqlstore", f.name, int64(f.size), int64(f.limit)); err != nil {
			return err
		}
	}
	return nil
}

// checkResponse refuses a response, with its headers encoded as hdr, that a
// column cannot hold whole (a server outside strict SQL mode would cut it
// short, a strict one fail the statement).
func checkResponse(resp *idem.Response, hdr []byte) error {
	if err := idem.CheckFieldSize("mysqlstore", "headers", int64(len(hdr)), MaxHeadersLength); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("mysqlstore", "body", int64(len(resp.Body)), MaxBodyLength); err != nil {
		return err
	}
	return idem.CheckFieldSize("mysqlstore", "ref", int64(len(resp.Ref)), MaxRefLength)
}

// Claim implements idem.Store. A plain read answers retries of live records
// (it can only refuse a claim); otherwise one INSERT … ON DUPLICATE KEY UPDATE
// decides the claim, the row is read back under the lock that statement took, in
// the same transaction, and the claim succeeded when the stored token is
// req.Token. A deadlock between concurrent claims of one key is retried.
func (s *Store) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if err := checkLengths(req.Scope, req.Key, req.Fingerprint, req.Token); err != nil {
		return nil, false, err
	}
	ins, err := s.stmt(ctx, s.q.claim)
	if err != nil {
		return nil, false, err
	}
	sel, err := s.stmt(ctx, s.q.claimRead)
	if err != nil {
		return nil, false, err
	}
	// Prepare the completion now, while this request holds no connection: preparing
	// it later, inside the handler's transaction, would need a second connection,
	// and with every pooled connection held by a transaction that wait never ends.
	if _, err := s.stmt(ctx, s.q.complete); err != nil {
		return nil, false, err
	}
	scope, key, fp, tok := []byte(req.Scope), []byte(req.Key), []byte(req.Fingerprint), []byte(req.Token)
	now, lease, exp := req.Now.UnixMicro(), req.LeaseUntil.UnixMicro(), req.ExpiresAt.UnixMicro()

	// Fast path for retries: a plain read of the committed row. When the row, as
	// read, fails the claim condition (it is live and complete, or in flight under
	// a live lease or another fingerprint), the atomic statement run at that
	// instant would have failed too, so the claim is decided "no" at the read, with
	// the record as read. This read never decides "yes": only the INSERT below
	// writes, and it re-evaluates the condition under the row lock. Replays and
	// 409s thus take no row lock and cost one round trip, and a burst of retries of
	// one key does not queue on that key's lock.
	get, err := s.stmt(ctx, s.q.get)
	if err != nil {
		return nil, false, err
	}
	rec, err := scanRecord(get.QueryRowContext(ctx, scope, key, now))
	switch {
	case err == nil && !claimable(rec, req):
		return rec, false, nil
	case errors.Is(err, sql.ErrNoRows):
		rec = nil
	case err != nil:
		return nil, false, s.wrap(err)
	}

	// The key is absent (or was, at the read): a plain INSERT claims it in one
	// round trip, with nothing to read back, since the stored row is exactly the
	// one inserted. A duplicate key means another request got there first (or the
	// read found a record to replace): the statement below decides then.
	if rec == nil {
		st, err := s.stmt(ctx, s.q.insertClaim)
		if err != nil {
			return nil, false, err
		}
		_, err = st.ExecContext(ctx, scope, key, fp, tok, now, lease, exp)
		if err == nil {
			return &idem.Record{Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
				Token: req.Token, CreatedAt: time.UnixMicro(now), LeaseUntil: time.UnixMicro(lease), ExpiresAt: time.UnixMicro(exp)}, true, nil
		}
		// ER_DUP_ENTRY, or a deadlock with a concurrent claim of the key (the
		// INSERT was rolled back): the statement below decides, retrying deadlocks.
		if code, ok := errorNumber(err); !ok || (code != 1062 && code != 1213) {
			return nil, false, s.wrap(err)
		}
	}

	ours := []any{tok, now, now, fp}                    // claimOurs
	args := []any{scope, key, fp, tok, now, lease, exp} // VALUES
	args = append(args, now, now, fp, tok)              // token
	args = append(append(args, ours...), now, now)      // created_at
	args = append(args, ours...)                        // state
	args = append(append(args, ours...), fp)            // fingerprint
	args = append(append(args, ours...), lease)         // lease_until
	args = append(append(args, ours...), exp)           // expires_at
	for range 6 {                                       // renewals, status, headers, body, body_omitted, ref
		args = append(args, ours...)
	}
	err = retry(ctx, func() error {
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.StmtContext(ctx, ins).ExecContext(ctx, args...); err != nil {
			return err
		}
		rec, err = scanRecord(tx.StmtContext(ctx, sel).QueryRowContext(ctx, scope, key))
		if err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return nil, false, s.wrap(err)
	}
	return rec, rec.Token == req.Token, nil
}

// claimable is the claim condition of the INSERT, evaluated on a record read
// unexpired at req.Now.
func claimable(rec *idem.Record, req idem.ClaimRequest) bool {
	return rec.State == idem.StateInFlight && rec.LeaseUntil.UnixMicro() <= req.Now.UnixMicro() && rec.Fingerprint == req.Fingerprint
}

// Complete implements idem.Store: a compare-and-set on token and state.
func (s *Store) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	if s.settings.Load() == nil {
		// checkPacket needs the server's max_allowed_packet: a statement over it
		// is refused, and the server may close the connection before the driver
		// reads why ("bad connection", a retryable store error every time).
		// Read once per Store, on a connection of the pool (no transaction of
		// the caller's holds one here); a failure leaves the check to the
		// server's answer.
		if conn, err := s.db.Conn(ctx); err == nil {
			_, _ = s.settingsFor(ctx, conn)
			_ = conn.Close()
		}
	}
	args, err := s.completeArgs(scope, key, token, resp, expiresAt)
	if err != nil {
		return err
	}
	err = s.execFenced(ctx, s.q.complete, args...)
	if perr := s.packetRefused(err, args[1].([]byte), args[2].([]byte), resp.Ref); perr != nil {
		return perr
	}
	return err
}

func (s *Store) completeArgs(scope, key, token string, resp *idem.Response, expiresAt time.Time) ([]any, error) {
	if resp == nil {
		return nil, errors.New("mysqlstore: Complete was given a nil *idem.Response")
	}
	if err := checkLengths(scope, key, "", token); err != nil {
		return nil, err
	}
	hdr, err := encodeHeaders(resp.Header)
	if err != nil {
		return nil, err
	}
	if err := checkResponse(resp, hdr); err != nil {
		return nil, err
	}
	if err := s.checkPacket(hdr, resp.Body, resp.Ref); err != nil {
		return nil, err
	}
	var body, ref []byte
	if resp.Body != nil {
		body = resp.Body
		if len(body) == 0 {
			body = []byte{} // stored as '' rather than NULL
		}
	}
	if resp.Ref != "" {
		ref = []byte(resp.Ref)
	}
	return []any{
		resp.Status, hdr, body, resp.BodyOmitted, ref, expiresAt.UnixMicro(),
		[]byte(scope), []byte(key), []byte(token),
	}, nil
}

// completeSQL is the complete query with completeArgs inlined as literals, for a
// group of statements sent together.
func completeSQL(q queries, args []any) string {
	omitted := "0"
	if args[3].(bool) {
		omitted = "1"
	}
	return "UPDATE " + q.table + " SET `state` = 2, `status` = " + strconv.Itoa(args[0].(int)) +
		", `headers` = " + lit(args[1].([]byte)) + ", `body` = " + lit(args[2].([]byte)) +
		", `body_omitted` = " + omitted + ", `ref` = " + lit(args[4].([]byte)) + ", `expires_at` = " + litInt(args[5].(int64)) +
		" WHERE `scope` = " + lit(args[6].([]byte)) + " AND `key` = " + lit(args[7].([]byte)) +
		" AND `token` = " + lit(args[8].([]byte)) + " AND `state` = 1"
}

// Release implements idem.Store: it deletes the record only while it is in flight
// under token.
func (s *Store) Release(ctx context.Context, scope, key, token string) error {
	return s.execFenced(ctx, s.q.release, []byte(scope), []byte(key), []byte(token))
}

// Extend implements idem.Store: it moves the lease only while the record is in
// flight under token.
func (s *Store) Extend(ctx context.Context, scope, key, token string, _, leaseUntil time.Time) error {
	return s.execFenced(ctx, s.q.extend, leaseUntil.UnixMicro(), leaseUntil.UnixMicro(), []byte(scope), []byte(key), []byte(token))
}

// execFenced runs a compare-and-set statement and turns "no row matched" into
// idem.ErrLockLost.
func (s *Store) execFenced(ctx context.Context, query string, args ...any) error {
	st, err := s.stmt(ctx, query)
	if err != nil {
		return err
	}
	var n int64
	err = retry(ctx, func() error {
		res, err := st.ExecContext(ctx, args...)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return s.wrap(err)
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// Get implements idem.Store.
func (s *Store) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	st, err := s.stmt(ctx, s.q.get)
	if err != nil {
		return nil, err
	}
	rec, err := scanRecord(st.QueryRowContext(ctx, []byte(scope), []byte(key), now.UnixMicro()))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, idem.ErrNotFound
	}
	if err != nil {
		return nil, s.wrap(err)
	}
	return rec, nil
}

// DeleteExpired implements idem.Store: one bounded DELETE … ORDER BY expires_at
// LIMIT limit.
func (s *Store) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	st, err := s.stmt(ctx, s.q.deleteExpired)
	if err != nil {
		return 0, err
	}
	var n int64
	err = retry(ctx, func() error {
		res, err := st.ExecContext(ctx, now.UnixMicro(), limit)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return int(n), s.wrap(err)
	}
	return int(n), nil
}

// scanRecord scans the columns of a record from a *sql.Row or *sql.Rows.
func scanRecord(row interface{ Scan(dest ...any) error }) (*idem.Record, error) {
	var (
		rec                     idem.Record
		scope, key, fp, tok     []byte
		state                   uint8
		created, lease, expires int64
		status                  sql.NullInt32
		hdr, body, ref          []byte
		omitted                 bool
	)
	if err := row.Scan(&scope, &key, &state, &fp, &tok, &created, &lease, &expires, &status, &hdr, &body, &omitted, &ref); err != nil {
		return nil, err
	}
	rec.Scope, rec.Key, rec.Fingerprint, rec.Token = string(scope), string(key), string(fp), string(tok)
	rec.State = idem.State(state)
	rec.CreatedAt, rec.LeaseUntil, rec.ExpiresAt = time.UnixMicro(created), time.UnixMicro(lease), time.UnixMicro(expires)
	if rec.State == idem.StateComplete {
		resp := &idem.Response{Status: int(status.Int32), Body: body, BodyOmitted: omitted, Ref: string(ref)}
		h, err := decodeHeaders(hdr)
		if err != nil {
			return nil, fmt.Errorf("mysqlstore: stored headers of (%q, %q): %w", rec.Scope, rec.Key, err)
		}
		resp.Header = h
		rec.Response = resp
	}
	return &rec, nil
}
