package mysqlstore

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

var _ idem.StepStore = (*Store)(nil)

// stepsSuffix makes the step records' table's name from the records table's.
const stepsSuffix = "_steps"

// Limits of the step records' columns.
const (
	// MaxStepOwnerLength is the longest step owner (a lock token) stored.
	MaxStepOwnerLength = 255
	// MaxDerivedKeyLength is the longest derived key stored.
	MaxDerivedKeyLength = 255
	// MaxStepResultLength is the longest recorded step result (a LONGBLOB);
	// the server's max_allowed_packet is usually the lower bound.
	MaxStepResultLength = 1<<32 - 1
)

// StepsTable returns the name of the step records' table: Table() + "_steps".
func (s *Store) StepsTable() string { return s.table + stepsSuffix }

// stepQueries builds the step statements. take is the condition under which
// a BeginStep takes the existing row (expired; or started and abandoned, or
// of another owner with Rerun). Parameters: now, rerun, owner.
func (s *Store) stepQueries() (insert, insertHolder, upsert, upsertHolder, read string) {
	t := quote(s.StepsTable())
	cols := "(`scope`, `key`, `name`, `state`, `owner`, `derived_key`, `result`, `started_at`, `expires_at`, `attempt`, `fingerprint`)"
	vals := " SELECT ?, ?, ?, 1, ?, ?, NULL, ?, ?, ?, ?"
	// The Holder fence is the SELECT's condition on the request record, read
	// with a shared lock that holds until the statement's transaction ends: no
	// takeover of the record commits between the check and the write. With
	// no row selected nothing is inserted nor updated.
	holder := " FROM " + s.q.table + " WHERE `scope` = ? AND `key` = ? AND `state` = 1 AND `token` = ? AND `expires_at` > ? LOCK IN SHARE MODE"
	// Columns of the step row, qualified: the SELECT's table (the records
	// table) has columns of the same names.
	c := func(col string) string { return t + ".`" + col + "`" }
	// other: a live row of another request (both fingerprints set, and
	// different: the key released and reused), left as it is. Parameters:
	// fingerprint, fingerprint.
	other := "(" + c("fingerprint") + " <> '' AND ? <> '' AND " + c("fingerprint") + " <> ?)"
	// Parameters of take: now, fingerprint, fingerprint, rerun, owner.
	take := "(" + c("expires_at") + " <= ? OR (NOT " + other + " AND " + c("state") + " = 1 AND (" + c("owner") + " = '' OR (? AND " + c("owner") + " <> ?))))"
	// ours is true, in each assignment after attempt's, exactly when this
	// statement takes the row, whatever the server's assignment semantics
	// (left to right, or MariaDB's SIMULTANEOUS_ASSIGNMENT): attempt is
	// assigned first, from take on the untouched row, and its new value is
	// this call's nonce, never in the old row. expires_at, which take and
	// expired read, is assigned last.
	ours := "(" + c("attempt") + " = ? OR " + take + ")"
	expired := c("expires_at") + " <= ?"
	odku := " ON DUPLICATE KEY UPDATE" +
		" `attempt` = IF(" + take + ", ?, " + c("attempt") + ")," +
		" `owner` = IF(" + ours + ", ?, " + c("owner") + ")," +
		" `state` = IF(" + expired + ", 1, " + c("state") + ")," +
		" `derived_key` = IF(" + expired + ", ?, " + c("derived_key") + ")," +
		" `result` = IF(" + expired + ", NULL, " + c("result") + ")," +
		" `started_at` = IF(" + expired + ", ?, " + c("started_at") + ")," +
		" `fingerprint` = IF(" + expired + ", ?, " + c("fingerprint") + ")," +
		" `seq` = " + c("seq") + " + 1," + // always changes: the affected-rows count says updated (2)
		" `expires_at` = IF(" + expired + ", ?, IF(" + other + ", " + c("expires_at") + ", GREATEST(" + c("expires_at") + ", ?)))"
	insert = "INSERT INTO " + t + " " + cols + vals
	insertHolder = insert + holder
	upsert = insert + odku
	upsertHolder = insertHolder + odku
	read = "SELECT `state`, `owner`, `derived_key`, `result`, `started_at`, `expires_at`, `fingerprint`, `attempt` = ? FROM " + t +
		" WHERE `scope` = ? AND `key` = ? AND `name` = ?"
	return
}

// otherOf is the FROM and WHERE of the live rows of a key whose fingerprint
// is set and differs from a request's, in the step table t (quoted).
// Parameters: scope, key, now, fingerprint. A range of the primary key
// (scope, key, name).
func otherOf(t string) string {
	return " FROM " + t + " AS `o` WHERE `o`.`scope` = ? AND `o`.`key` = ? AND `o`.`expires_at` > ? AND `o`.`fingerprint` <> '' AND `o`.`fingerprint` <> ?"
}

// firstInsertQueries are stepQueries' insert and insertHolder for a
// BeginStep with First: they insert nothing while another request's row of
// the key lives (parameters after the others: scope, key, now, fingerprint).
func (s *Store) firstInsertQueries() (insert, insertHolder string) {
	t := quote(s.StepsTable())
	cols := "(`scope`, `key`, `name`, `state`, `owner`, `derived_key`, `result`, `started_at`, `expires_at`, `attempt`, `fingerprint`)"
	vals := " SELECT ?, ?, ?, 1, ?, ?, NULL, ?, ?, ?, ?"
	none := "NOT EXISTS (SELECT 1" + otherOf(t) + ")"
	insert = "INSERT INTO " + t + " " + cols + vals + " FROM DUAL WHERE " + none
	insertHolder = "INSERT INTO " + t + " " + cols + vals + " FROM " + s.q.table +
		" WHERE `scope` = ? AND `key` = ? AND `state` = 1 AND `token` = ? AND `expires_at` > ? AND " + none + " LOCK IN SHARE MODE"
	return
}

// otherStep returns a live row of req's key of another request than req's
// fingerprint, or nil; with req.Holder, ErrLockLost when the request record
// is not held by req.Owner.
func (s *Store) otherStep(ctx context.Context, d *stepDB, req idem.BeginStepRequest) (*idem.StepRecord, error) {
	t := quote(s.StepsTable())
	held := "1"
	args := []any{}
	if req.Holder {
		held = "EXISTS (SELECT 1 FROM " + s.q.table + " WHERE `scope` = ? AND `key` = ? AND `state` = 1 AND `token` = ? AND `expires_at` > ?)"
		args = append(args, []byte(req.Scope), []byte(req.Key), []byte(req.Owner), req.Now.UnixMicro())
	}
	args = append(args, []byte(req.Scope), []byte(req.Key), req.Now.UnixMicro(), []byte(req.Fingerprint))
	q := "SELECT " + held + ", `o`.`name`, `o`.`state`, `o`.`owner`, `o`.`derived_key`, `o`.`result`, `o`.`started_at`, `o`.`expires_at`, `o`.`fingerprint`" +
		" FROM (SELECT 1 AS `one`) AS `d` LEFT JOIN (SELECT *" + otherOf(t) + " LIMIT 1) AS `o` ON 1"
	row, err := d.queryRow(ctx, q, args...)
	if err != nil {
		return nil, s.wrapSteps(err)
	}
	var h bool
	var name, owner, dk, fp []byte
	var state sql.NullInt16
	var started, expires sql.NullInt64
	r := &idem.StepRecord{Scope: req.Scope, Key: req.Key}
	if err := row.Scan(&h, &name, &state, &owner, &dk, &r.Result, &started, &expires, &fp); err != nil {
		return nil, s.wrapSteps(err)
	}
	if !h {
		return nil, idem.ErrLockLost
	}
	if !state.Valid {
		return nil, nil
	}
	r.Name, r.State, r.Owner, r.DerivedKey, r.Fingerprint = string(name), idem.StepState(state.Int16), string(owner), string(dk), string(fp)
	r.StartedAt, r.ExpiresAt = time.UnixMicro(started.Int64), time.UnixMicro(expires.Int64)
	return r, nil
}

// checkStep refuses what the columns cannot hold or no caller may pass:
// empty or overlong names, NUL bytes in names and owners.
func checkStep(scope, key, name, owner string) error {
	if err := checkLengths(scope, key, "", ""); err != nil {
		return err
	}
	if name == "" {
		return errors.New("mysqlstore: the step name is empty; name every step")
	}
	if err := idem.CheckFieldSize("mysqlstore", "step name", int64(len(name)), idem.MaxStepNameLength); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("mysqlstore", "step owner", int64(len(owner)), MaxStepOwnerLength); err != nil {
		return err
	}
	if strings.IndexByte(name, 0) >= 0 || strings.IndexByte(owner, 0) >= 0 {
		return errors.New("mysqlstore: a step name or owner contains a NUL byte; use visible ASCII")
	}
	return nil
}

func (s *Store) checkStepResult(ctx context.Context, d *stepDB, result []byte) ([]byte, error) {
	if err := idem.CheckFieldSize("mysqlstore", "step result", int64(len(result)), MaxStepResultLength); err != nil {
		return nil, err
	}
	// The result travels in one statement: over the server's
	// max_allowed_packet it is refused every time (and the server may close
	// the connection before the driver reads why). Read the setting once per
	// Store, as Complete does.
	if s.settings.Load() == nil && d.c != nil {
		_, _ = s.settingsFor(ctx, d.c)
	} else if s.settings.Load() == nil {
		if conn, err := s.db.Conn(ctx); err == nil {
			_, _ = s.settingsFor(ctx, conn)
			_ = conn.Close()
		}
	}
	if st := s.settings.Load(); st != nil && st.maxPacket > 0 && int64(len(result))+packetOverhead > st.maxPacket {
		return nil, stepPacketError(st.maxPacket, len(result))
	}
	if result == nil {
		result = []byte{}
	}
	return result, nil
}

// stepPacketError is the *idem.FieldTooLargeError of a step result that does
// not fit in one packet of maxPacket bytes (0 when not known).
func stepPacketError(maxPacket int64, size int) error {
	fte := &idem.FieldTooLargeError{Store: "mysqlstore", Field: "step result", Size: int64(size), Limit: max(maxPacket-packetOverhead, 0)}
	return fmt.Errorf("%w (the step result travels in one statement, and the server's max_allowed_packet is %d bytes)", fte, maxPacket)
}

// stepPacketRefused turns the server's or the driver's refusal of a statement
// over max_allowed_packet into stepPacketError; nil for any other error.
func (s *Store) stepPacketRefused(err error, size int) error {
	if err == nil {
		return nil
	}
	code, ok := errorNumber(err)
	if !(ok && code == 1153) && !strings.Contains(err.Error(), "packet for query is too large") {
		return nil
	}
	var maxPacket int64
	if st := s.settings.Load(); st != nil {
		maxPacket = st.maxPacket
	}
	return errors.Join(stepPacketError(maxPacket, size), err)
}

func stepNonce() []byte {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return []byte(hex.EncodeToString(b[:]))
}

// stepAcquireTimeout bounds a step statement's wait for a pool connection
// when the pool is full. A step runs while its handler's transaction holds a
// connection of the same pool: with every connection held by handlers that
// each wait for a step, no wait ends, so it is cut short with an error that
// says what to do.
const stepAcquireTimeout = 5 * time.Second

// stepDB is where one step operation's statements run. With room in the pool
// (fewer connections in use than SetMaxOpenConns, or no limit) they run on
// the pool, with the Store's prepared statements, as any statement does.
// With the pool full they run on one connection acquired within
// stepAcquireTimeout, by their text: a statement that waited in the pool's
// queue would wait with no bound. (The one whose check found room and then
// lost it to another waits in the queue; it cannot wait for ever on handlers
// that wait for steps, since the last of those to begin its transaction
// filled the pool before its step looked, so that step's wait is bounded and
// ends, freeing a connection.)
type stepDB struct {
	s *Store
	c *sql.Conn // nil: the pool
}

// stepConn returns where a step operation's statements run (see stepDB);
// release it with close.
func (s *Store) stepConn(ctx context.Context) (*stepDB, error) {
	st := s.db.Stats()
	if (st.MaxOpenConnections <= 0 || st.InUse < st.MaxOpenConnections) && !s.stepOwnConn.Load() {
		return &stepDB{s: s}, nil
	}
	actx, cancel := context.WithTimeout(ctx, stepAcquireTimeout)
	defer cancel()
	c, err := s.db.Conn(actx)
	if err != nil && ctx.Err() == nil && actx.Err() != nil {
		st = s.db.Stats()
		return nil, fmt.Errorf("mysqlstore: no pool connection came free for the step's statement within %v (%d of SetMaxOpenConns %d in use, most likely by running handlers' transactions, each waiting for a step): a step needs a connection beside its handler's transaction, so raise sql.DB.SetMaxOpenConns above the requests that run steps at once (twice them leaves every one a connection for its transaction and one for its step), and the server's max_connections with it: %w", stepAcquireTimeout, st.InUse, st.MaxOpenConnections, err)
	}
	if err != nil {
		return nil, s.wrapSteps(err)
	}
	return &stepDB{s: s, c: c}, nil
}

func (d *stepDB) close() {
	if d.c != nil {
		_ = d.c.Close()
	}
}

func (d *stepDB) exec(ctx context.Context, q string, args ...any) (sql.Result, error) {
	if d.c != nil {
		return d.c.ExecContext(ctx, q, args...)
	}
	st, err := d.s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	return st.ExecContext(ctx, args...)
}

func (d *stepDB) queryRow(ctx context.Context, q string, args ...any) (*sql.Row, error) {
	if d.c != nil {
		return d.c.QueryRowContext(ctx, q, args...), nil
	}
	st, err := d.s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	return st.QueryRowContext(ctx, args...), nil
}

func (d *stepDB) query(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	if d.c != nil {
		return d.c.QueryContext(ctx, q, args...)
	}
	st, err := d.s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	return st.QueryContext(ctx, args...)
}

// prepare prepares qs on the pool, for txExec and txQueryRow to use without
// waiting for a connection of the pool while their transaction holds locks;
// on a connection of its own there is nothing to prepare.
func (d *stepDB) prepare(ctx context.Context, qs ...string) error {
	if d.c != nil {
		return nil
	}
	for _, q := range qs {
		if _, err := d.s.stmt(ctx, q); err != nil {
			return err
		}
	}
	return nil
}

func (d *stepDB) beginTx(ctx context.Context) (*sql.Tx, error) {
	if d.c != nil {
		return d.c.BeginTx(ctx, nil)
	}
	return d.s.db.BeginTx(ctx, nil)
}

// txExec runs q in tx: by the prepared statement on the pool, by its text on
// a connection of its own.
func (d *stepDB) txExec(ctx context.Context, tx *sql.Tx, q string, args ...any) (sql.Result, error) {
	if d.c != nil {
		return tx.ExecContext(ctx, q, args...)
	}
	st, err := d.s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	return tx.StmtContext(ctx, st).ExecContext(ctx, args...)
}

func (d *stepDB) txQueryRow(ctx context.Context, tx *sql.Tx, q string, args ...any) (*sql.Row, error) {
	if d.c != nil {
		return tx.QueryRowContext(ctx, q, args...), nil
	}
	st, err := d.s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	return tx.StmtContext(ctx, st).QueryRowContext(ctx, args...), nil
}

// BeginStep implements idem.StepStore. A first BeginStep of a step, the
// common case, is one autocommitted INSERT … SELECT (one round trip): with
// Holder the SELECT reads the request record under a shared lock, and no row
// selected means the fence failed. When the step's row exists (error 1062), a
// transaction decides: INSERT … SELECT … ON DUPLICATE KEY UPDATE, whose
// assignments take the row or leave it (moving only its expiry) under the
// row's exclusive lock, then a read of the row in the same transaction, then
// COMMIT; deadlocks between concurrent BeginSteps of one new step are
// retried.
func (s *Store) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	if err := checkStep(req.Scope, req.Key, req.Name, req.Owner); err != nil {
		return nil, false, err
	}
	if req.DerivedKey == "" || strings.IndexByte(req.DerivedKey, 0) >= 0 {
		return nil, false, errors.New("mysqlstore: begin step: the derived key is empty or contains a NUL byte")
	}
	if err := idem.CheckFieldSize("mysqlstore", "step derived key", int64(len(req.DerivedKey)), MaxDerivedKeyLength); err != nil {
		return nil, false, err
	}
	if err := idem.CheckFieldSize("mysqlstore", "step fingerprint", int64(len(req.Fingerprint)), MaxFingerprintLength); err != nil {
		return nil, false, err
	}
	insert, insertHolder, upsert, upsertHolder, read := s.stepQueries()
	scope, key, name, owner, dk, fp := []byte(req.Scope), []byte(req.Key), []byte(req.Name), []byte(req.Owner), []byte(req.DerivedKey), []byte(req.Fingerprint)
	now, exp := req.Now.UnixMicro(), req.ExpiresAt.UnixMicro()
	nonce := stepNonce()
	args := []any{scope, key, name, owner, dk, now, exp, nonce, fp}
	first := req.First && req.Fingerprint != ""
	if first {
		// The INSERT selects nothing while another request's row of the key
		// lives: the check costs no round trip more.
		insert, insertHolder = s.firstInsertQueries()
	}
	if req.Holder {
		insert, upsert = insertHolder, upsertHolder
		args = append(args, scope, key, owner, now)
	}
	iargs := args
	if first {
		iargs = append(append([]any{}, args...), scope, key, now, fp)
	}
	mine := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name, State: idem.StepStarted, Owner: req.Owner,
		DerivedKey: req.DerivedKey, Fingerprint: req.Fingerprint, StartedAt: req.Now, ExpiresAt: req.ExpiresAt}

	d, err := s.stepConn(ctx)
	if err != nil {
		return nil, false, err
	}
	defer d.close()
	res, err := d.exec(ctx, insert, iargs...)
	if err == nil {
		n, err := res.RowsAffected()
		if err != nil {
			return nil, false, s.wrapSteps(err)
		}
		if n == 0 && first {
			// The fence failed, or another request's row lives: which one?
			if o, err := s.otherStep(ctx, d, req); err != nil || o != nil {
				return o, false, err
			}
		}
		if n == 0 {
			return nil, false, idem.ErrLockLost
		}
		return mine, true, nil
	}
	if code, ok := errorNumber(err); !ok || (code != 1062 && code != 1213) {
		return nil, false, s.wrapSteps(err)
	}
	// The step exists: read it, decide, and write the decision only if the
	// row is still the version read (compare-and-set on seq).
	if rec, began, ok, err := s.casStep(ctx, d, req, nonce); err != nil {
		return nil, false, err
	} else if ok {
		return rec, began, nil
	}

	if first {
		// Rare (the row changed under every optimistic round): a read of its
		// own before the transaction. The request record, held while the
		// execution's steps are begun, keeps another request from writing
		// one meanwhile.
		if o, err := s.otherStep(ctx, d, req); err != nil || o != nil {
			return o, false, err
		}
	}
	rerun := req.Rerun
	take := []any{now, fp, fp, rerun, owner}
	ours := append([]any{nonce}, take...)
	uargs := append([]any{}, args...)
	uargs = append(append(uargs, take...), nonce) // attempt
	uargs = append(append(uargs, ours...), owner) // owner
	uargs = append(uargs, now)                    // state
	uargs = append(uargs, now, dk)                // derived_key
	uargs = append(uargs, now)                    // result
	uargs = append(uargs, now, now)               // started_at
	uargs = append(uargs, now, fp)                // fingerprint
	uargs = append(uargs, now, exp, fp, fp, exp)  // expires_at
	// Prepare the transaction's statements before it takes the row's lock:
	// preparing on the pool may wait for a connection, and the connections
	// may all be held by BeginSteps queued on that lock.
	if err := d.prepare(ctx, upsert, read); err != nil {
		return nil, false, s.wrapSteps(err)
	}
	var rec *idem.StepRecord
	var began bool
	err = retry(ctx, func() error {
		rec, began = nil, false
		tx, err := d.beginTx(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		res, err := d.txExec(ctx, tx, upsert, uargs...)
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		switch n {
		case 0:
			return idem.ErrLockLost
		case 1: // the row went meanwhile: inserted
			rec, began = mine, true
			return tx.Commit()
		}
		r := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name}
		var state uint8
		var started, expires int64
		var owner, dk, rfp []byte
		row, err := d.txQueryRow(ctx, tx, read, nonce, scope, key, name)
		if err != nil {
			return err
		}
		if err := row.Scan(&state, &owner, &dk, &r.Result, &started, &expires, &rfp, &began); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		r.State, r.Owner, r.DerivedKey, r.Fingerprint = idem.StepState(state), string(owner), string(dk), string(rfp)
		r.StartedAt, r.ExpiresAt = time.UnixMicro(started), time.UnixMicro(expires)
		if started == now {
			r.StartedAt = req.Now
		}
		if expires == exp {
			r.ExpiresAt = req.ExpiresAt
		}
		rec = r
		return nil
	})
	if errors.Is(err, idem.ErrLockLost) {
		return nil, false, err
	}
	if err != nil {
		return nil, false, s.wrapSteps(err)
	}
	return rec, began, nil
}

// maxCASRounds bounds casStep's optimistic rounds before BeginStep falls
// back to its transaction.
const maxCASRounds = 4

// casStep decides BeginStep of an existing step optimistically, in
// autocommitted statements: one plain read of the row (with its seq, which
// every write bumps) and, with req.Holder, of whether the request record is
// held, in one snapshot; the decision in Go; then, unless there is nothing
// to write (a replay that moves no expiry: one round trip), one UPDATE of
// what changes, conditioned on seq and attempt being the ones read (and with req.Holder
// on the request record, read LOCK IN SHARE MODE). A matched UPDATE is the
// decision applied to the version read, atomically. ok is false when the
// row is absent, or changed under every round: the caller decides otherwise.
func (s *Store) casStep(ctx context.Context, d *stepDB, req idem.BeginStepRequest, nonce []byte) (rec *idem.StepRecord, began, ok bool, err error) {
	t := quote(s.StepsTable())
	pk := " WHERE `scope` = ? AND `key` = ? AND `name` = ?"
	held, fence := "1", ""
	var hargs []any
	if req.Holder {
		cond := " FROM " + s.q.table + " WHERE `scope` = ? AND `key` = ? AND `state` = 1 AND `token` = ? AND `expires_at` > ?"
		held = "EXISTS (SELECT 1" + cond + ")"
		fence = " AND EXISTS (SELECT 1" + cond + " LOCK IN SHARE MODE)"
		hargs = []any{[]byte(req.Scope), []byte(req.Key), []byte(req.Owner), req.Now.UnixMicro()}
	}
	pkArgs := []any{[]byte(req.Scope), []byte(req.Key), []byte(req.Name)}
	// With First, the read also says whether another request's row of the
	// key lives, in the same round trip.
	oth, oargs := "0", []any(nil)
	if req.First && req.Fingerprint != "" {
		oth = "EXISTS (SELECT 1" + otherOf(t) + ")"
		oargs = []any{[]byte(req.Scope), []byte(req.Key), req.Now.UnixMicro(), []byte(req.Fingerprint)}
	}
	read := "SELECT " + held + ", " + oth + ", `state`, `owner`, `derived_key`, `result`, `started_at`, `expires_at`, `seq`, `attempt`, `fingerprint` FROM " + t + pk
	now, exp := req.Now.UnixMicro(), req.ExpiresAt.UnixMicro()
	rounds := maxCASRounds
	if s.noStepCAS.Load() {
		rounds = 0
	}
	for range rounds {
		var h, o bool
		var state uint8
		var owner, dk []byte
		var started, expires int64
		var seq uint64
		var attempt, rfp []byte
		r := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name}
		row, err := d.queryRow(ctx, read, append(append(append([]any{}, hargs...), oargs...), pkArgs...)...)
		if err != nil {
			return nil, false, false, s.wrapSteps(err)
		}
		err = row.Scan(&h, &o, &state, &owner, &dk, &r.Result, &started, &expires, &seq, &attempt, &rfp)
		if errors.Is(err, sql.ErrNoRows) {
			return nil, false, false, nil
		}
		if err != nil {
			return nil, false, false, s.wrapSteps(err)
		}
		if !h {
			return nil, false, false, idem.ErrLockLost
		}
		if o {
			other, err := s.otherStep(ctx, d, req)
			if err != nil || other != nil {
				return other, false, err == nil, err
			}
			continue // gone meanwhile: read again
		}
		r.State, r.Owner, r.DerivedKey, r.Fingerprint = idem.StepState(state), string(owner), string(dk), string(rfp)
		r.StartedAt, r.ExpiresAt = time.UnixMicro(started), time.UnixMicro(expires)
		other := r.Fingerprint != "" && req.Fingerprint != "" && r.Fingerprint != req.Fingerprint
		var q string
		var args []any
		switch {
		case expires <= now: // expired: a new record
			q = "UPDATE " + t + " SET `state` = 1, `owner` = ?, `derived_key` = ?, `result` = NULL, `started_at` = ?, `expires_at` = ?, `attempt` = ?, `fingerprint` = ?, `seq` = `seq` + 1"
			args = []any{[]byte(req.Owner), []byte(req.DerivedKey), now, exp, nonce, []byte(req.Fingerprint)}
			r = &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name, State: idem.StepStarted, Owner: req.Owner,
				DerivedKey: req.DerivedKey, Fingerprint: req.Fingerprint, StartedAt: req.Now, ExpiresAt: req.ExpiresAt}
			began = true
		case other: // another request's: left as it is
			return r, false, true, nil
		case r.State == idem.StepStarted && (r.Owner == "" || (req.Rerun && r.Owner != req.Owner)): // taken
			q = "UPDATE " + t + " SET `owner` = ?, `attempt` = ?, `expires_at` = GREATEST(`expires_at`, ?), `seq` = `seq` + 1"
			args = []any{[]byte(req.Owner), nonce, exp}
			r.Owner, began = req.Owner, true
		case exp > expires: // left, its expiry moved
			q = "UPDATE " + t + " SET `expires_at` = ?, `seq` = `seq` + 1"
			args = []any{exp}
			began = false
		default: // nothing to write
			return r, false, true, nil
		}
		if exp > expires {
			r.ExpiresAt = req.ExpiresAt
		}
		// seq is the version within one row's life, attempt (a random nonce
		// set by every insert) tells the row from one deleted and inserted
		// anew meanwhile, whose seq starts again.
		q += pk + " AND `seq` = ? AND `attempt` = ?" + fence
		args = append(append(append(args, pkArgs...), seq, attempt), hargs...)
		var n int64
		err = retry(ctx, func() error {
			res, err := d.exec(ctx, q, args...)
			if err != nil {
				return err
			}
			n, err = res.RowsAffected()
			return err
		})
		if err != nil {
			return nil, false, false, s.wrapSteps(err)
		}
		if n == 1 {
			return r, began, true, nil
		}
		// The row changed since the read, or the fence broke: read again.
	}
	return nil, false, false, nil
}

// stepExec runs one autocommitted statement on d and returns the rows it
// changed.
func (s *Store) stepExec(ctx context.Context, d *stepDB, q string, args ...any) (int64, error) {
	var n int64
	err := retry(ctx, func() error {
		res, err := d.exec(ctx, q, args...)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return 0, s.wrapSteps(err)
	}
	return n, nil
}

// live is the condition of the live row of (scope, key, name) at now.
const live = " WHERE `scope` = ? AND `key` = ? AND `name` = ? AND `expires_at` > ?"

// FinishStep implements idem.StepStore: one fenced UPDATE (state changes from
// 1, so a matched row is a changed row).
func (s *Store) FinishStep(ctx context.Context, scope, key, name, owner string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(scope, key, name, owner); err != nil {
		return err
	}
	if state != idem.StepDone && state != idem.StepFailed {
		return fmt.Errorf("mysqlstore: finish step: state %v; a step finishes done or failed", state)
	}
	d, err := s.stepConn(ctx)
	if err != nil {
		return err
	}
	defer d.close()
	result, err = s.checkStepResult(ctx, d, result)
	if err != nil {
		return err
	}
	n, err := s.stepExec(ctx, d, "UPDATE "+quote(s.StepsTable())+" SET `state` = ?, `result` = ?, `seq` = `seq` + 1"+live+
		" AND `state` = 1 AND `owner` = ? AND `owner` <> ''",
		uint8(state), result, []byte(scope), []byte(key), []byte(name), now.UnixMicro(), []byte(owner))
	if perr := s.stepPacketRefused(err, len(result)); perr != nil {
		return perr
	}
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
	if err := checkStep(scope, key, name, owner); err != nil {
		return err
	}
	d, err := s.stepConn(ctx)
	if err != nil {
		return err
	}
	defer d.close()
	n, err := s.stepExec(ctx, d, "UPDATE "+quote(s.StepsTable())+" SET `owner` = '', `seq` = `seq` + 1"+live+
		" AND `state` = 1 AND `owner` = ? AND `owner` <> ''",
		[]byte(scope), []byte(key), []byte(name), now.UnixMicro(), []byte(owner))
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// GetSteps implements idem.StepStore: one plain read.
func (s *Store) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	if err := checkLengths(scope, key, "", ""); err != nil {
		return nil, err
	}
	d, err := s.stepConn(ctx)
	if err != nil {
		return nil, err
	}
	defer d.close()
	rows, err := d.query(ctx, "SELECT `name`, `state`, `owner`, `derived_key`, `result`, `started_at`, `expires_at`, `fingerprint` FROM "+quote(s.StepsTable())+
		" WHERE `scope` = ? AND `key` = ? AND `expires_at` > ? ORDER BY `started_at`, `name`",
		[]byte(scope), []byte(key), now.UnixMicro())
	if noStepsTable(err) {
		return nil, nil // a database not migrated since step records came: none was written
	}
	if err != nil {
		return nil, s.wrapSteps(err)
	}
	defer rows.Close()
	var out []idem.StepRecord
	for rows.Next() {
		r := idem.StepRecord{Scope: scope, Key: key}
		var name, owner, dk, fp []byte
		var state uint8
		var started, expires int64
		if err := rows.Scan(&name, &state, &owner, &dk, &r.Result, &started, &expires, &fp); err != nil {
			return nil, s.wrapSteps(err)
		}
		r.Name, r.State, r.Owner, r.DerivedKey, r.Fingerprint = string(name), idem.StepState(state), string(owner), string(dk), string(fp)
		r.StartedAt, r.ExpiresAt = time.UnixMicro(started), time.UnixMicro(expires)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrapSteps(err)
	}
	return out, nil
}

// SettleStep implements idem.StepStore: one UPDATE, or one DELETE for state 0.
func (s *Store) SettleStep(ctx context.Context, scope, key, name string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(scope, key, name, ""); err != nil {
		return err
	}
	t := quote(s.StepsTable())
	args := []any{[]byte(scope), []byte(key), []byte(name), now.UnixMicro()}
	d, err := s.stepConn(ctx)
	if err != nil {
		return err
	}
	defer d.close()
	var q string
	switch state {
	case 0:
		q = "DELETE FROM " + t + live
	case idem.StepDone, idem.StepFailed:
		if result, err = s.checkStepResult(ctx, d, result); err != nil {
			return err
		}
		q = "UPDATE " + t + " SET `state` = ?, `result` = ?, `seq` = `seq` + 1" + live
		args = append([]any{uint8(state), result}, args...)
	default:
		return fmt.Errorf("mysqlstore: settle step: state %v; settle a step as done or failed, or 0 to forget it", state)
	}
	n, err := s.stepExec(ctx, d, q, args...)
	if perr := s.stepPacketRefused(err, len(result)); perr != nil {
		return perr
	}
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrNotFound
	}
	return nil
}

// DeleteExpiredSteps implements idem.StepStore: one bounded DELETE in the
// order of the expires_at index (deterministic, as statement-based
// replication requires of DELETE … LIMIT).
func (s *Store) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	// The janitor holds no transaction: it waits on the pool as any
	// statement does.
	n, err := s.stepExec(ctx, &stepDB{s: s}, "DELETE FROM "+quote(s.StepsTable())+
		" WHERE `expires_at` <= ? ORDER BY `expires_at`, `scope`, `key`, `name` LIMIT ?", now.UnixMicro(), limit)
	if noStepsTable(err) {
		// A database not migrated since step records came, under a service
		// that records none: nothing to delete, and its janitor sweeps on.
		return 0, nil
	}
	return int(n), err
}

// noStepsTable reports the server's "table does not exist" (1146), which is
// the step records' table's when the statement touches no other.
func noStepsTable(err error) bool {
	code, ok := errorNumber(err)
	return err != nil && ok && code == 1146
}

// wrapSteps is wrap for the step records' table.
func (s *Store) wrapSteps(err error) error {
	if err == nil {
		return nil
	}
	if code, ok := errorNumber(err); ok && code == 1146 {
		return fmt.Errorf("mysqlstore: table %s does not exist; run (*mysqlstore.Store).Migrate or `idem migrate` first: %w", quote(s.StepsTable()), err)
	}
	if code, ok := errorNumber(err); ok && code == 1054 {
		return fmt.Errorf("mysqlstore: table %s lacks a column this release writes (fingerprint, from migration 003_steps_fingerprint); run (*mysqlstore.Store).Migrate or `idem migrate` first: %w", quote(s.StepsTable()), err)
	}
	if strings.HasPrefix(err.Error(), "mysqlstore: ") {
		return err
	}
	return fmt.Errorf("mysqlstore: %w", err)
}
