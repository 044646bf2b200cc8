package mysqlstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

var _ idem.SingleTxStore = (*Store)(nil)

// lockExpr returns the SQL expression naming the GET_LOCK lock of (scope, key) in
// this store's table and the connection's database. Lock names are global to the
// server and at most 64 characters, so the name is a hash: "idem:" and 40 hex
// digits. The Go-side hash is hex, so it is inlined as a literal and the lock
// statements need no parameters (one round trip each, without preparing).
func (s *Store) lockExpr(scope, key string) string {
	h := sha256.New()
	var n [8]byte
	for _, part := range []string{s.table, scope, key} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return "CONCAT('idem:', LEFT(SHA2(CONCAT(IFNULL(DATABASE(), ''), ':', '" + hex.EncodeToString(h.Sum(nil)) + "'), 256), 40))"
}

// PreferredFlow implements idem.FlowPreferrer: the single-transaction flow, which
// commits once per request (claim-then-complete commits the claim on its own,
// then the transaction: two commits, two log flushes) and needs fewer round
// trips.
func (s *Store) PreferredFlow() idem.Flow { return idem.FlowSingleTx }

var _ idem.FlowPreferrer = (*Store)(nil)

// BeginLocked implements idem.SingleTxStore. On one connection taken from the pool
// for the whole request, it first reads the record without any lock: a live
// record (a replay, a 422 or a 409 for the middleware) is returned at once, and
// the connection goes back to the pool as it was. Otherwise it takes the named
// lock of (scope, key) with GET_LOCK without waiting, begins a READ COMMITTED
// transaction, guarded as BeginTx's is, and reads the record again in it (one may
// have been committed between the first read and the lock). rec is nil when
// there is none or it expired at now. When the lock is held elsewhere it reads
// the record once more: a complete record committed by the holder is returned
// (concurrent retries of a finished request are replays), none means
// idem.ErrInFlight.
//
// The lock is taken in the statement that turns autocommit off: SET autocommit =
// IF(GET_LOCK(name, 0) = 1, 0, 2) fails (error 1231), changing nothing, when the
// lock is held elsewhere. With multiStatements on the connections, the lock-free
// read and that statement go in one round trip, the SET taking the lock only when
// the read returned no row (FOUND_ROWS() = 0); then START TRANSACTION; then the
// savepoint and the read in the transaction in one more. Commit sends the
// savepoint check, the record, COMMIT, and autocommit back on with the lock's
// release in one round trip.
//
// A live record read without the lock is the record as it is: a complete one
// does not change before it expires, and an in-flight one (claim-then-complete)
// is only ever taken over through the fenced Claim.
//
// GET_LOCK belongs to the session, not the transaction: Commit and Rollback
// release it explicitly after ending the transaction, and when that cannot be
// confirmed the connection is closed instead of returned to the pool, which frees
// the lock on the server. A process that dies holding it loses its connection, and
// the server frees the lock and rolls the transaction back.
func (s *Store) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	if err := checkLengths(scope, key, "", ""); err != nil {
		return ctx, nil, nil, err
	}
	// Prepare before taking a connection: preparing needs one of its own. The
	// record goes through it only when too large to send as text (inlineLimit).
	ins, err := s.stmt(ctx, s.q.lockedInsert)
	if err != nil {
		return ctx, nil, nil, err
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return ctx, nil, nil, s.wrap(err)
	}
	st, err := s.settingsFor(ctx, conn)
	if err != nil {
		discard(conn)
		return ctx, nil, nil, err
	}
	lt := &lockedTx{s: s, st: st, conn: conn, lock: s.lockExpr(scope, key), now: now, scope: scope, key: key, ins: ins}
	read := "SELECT " + columns + " FROM " + s.q.table + " WHERE `scope` = " + litString(scope) + " AND `key` = " + litString(key)
	// The second read needs only the expiry (a row and its 13 column
	// definitions cost the client more than the round trip's other packets).
	check := "SELECT `expires_at` FROM " + s.q.table + " WHERE `scope` = " + litString(scope) + " AND `key` = " + litString(key)
	if st.multi && st.foundRows {
		return s.beginLockedConn(ctx, lt, read, check)
	}
	rec, locked, err := s.readOrLock(ctx, conn, st, lt.lock, read+" AND `expires_at` > "+litInt(now.UnixMicro()))
	switch {
	case err != nil:
		lt.discard()
		return ctx, nil, nil, s.wrap(fmt.Errorf("reading the record and taking the key's lock: %w", err))
	case rec != nil:
		_ = conn.Close()
		return ctx, &lockedTx{done: true}, rec, nil
	case !locked:
		_ = conn.Close()
		return ctx, nil, nil, idem.ErrInFlight
	}
	// The lock is held and autocommit off from here: on failure the connection is
	// closed, which frees both.
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		lt.discard()
		return ctx, nil, nil, s.wrap(err)
	}
	lt.tx, lt.ctx = tx, ctx
	rows, _, err := run(ctx, st, tx, true, mark, check)
	if err != nil {
		_ = tx.Rollback()
		lt.discard()
		return ctx, nil, nil, s.wrap(fmt.Errorf("beginning the transaction: %w", err))
	}
	var expires sql.NullInt64
	for rows.Next() {
		if err = rows.Scan(&expires); err != nil {
			break
		}
	}
	if cerr := rows.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		_ = lt.Rollback(ctx)
		return ctx, nil, nil, s.wrap(err)
	case !expires.Valid:
	case expires.Int64 <= now.UnixMicro():
		lt.expired = true
	default:
		// Committed between the lock-free read and the lock: read it whole.
		rec, err = scanRecord(tx.QueryRowContext(ctx, read))
		_ = lt.Rollback(ctx)
		if err != nil {
			return ctx, nil, nil, s.wrap(err)
		}
		return ctx, &lockedTx{done: true}, rec, nil
	}
	return context.WithValue(ctx, txKey{}, &txn{s: s, st: st, tx: lt.tx, ctx: ctx}), lt, nil, nil
}

// beginLockedConn is BeginLocked on connections that take several statements
// (multiStatements) on a server with FOUND_ROWS(): the lock-free read, the
// guard that takes the key's lock and turns autocommit off, the savepoint that
// begins the transaction and the read of the record's expiry under the lock
// go in one round trip; the batch stops at the guard, which fails (1231),
// when the read found a live record or the lock is held elsewhere. The
// transaction is the session's own (autocommit off), not a *sql.Tx: the
// handler runs its statements on the connection (Conn), and Commit sends the
// record, COMMIT and the lock's release in one more round trip, so a
// first-time request costs three round trips with the handler's one statement.
// A handler that asks for a *sql.Tx (Tx) gets one begun then, at the cost of
// two more round trips (START TRANSACTION and the savepoint).
func (s *Store) beginLockedConn(ctx context.Context, lt *lockedTx, read, check string) (context.Context, idem.LockedTx, *idem.Record, error) {
	conn, st, now := lt.conn, lt.st, lt.now
	take := "GET_LOCK(" + lt.lock + ", 0) = 1"
	guard := "SET autocommit = IF(IF(FOUND_ROWS() > 0, 0, " + take + "), 0, 2), " + s.isolationSQL(st)
	live := read + " AND `expires_at` > " + litInt(now.UnixMicro())
	rows, err := conn.QueryContext(ctx, live+"; "+guard+"; "+mark+"; "+check)
	if err != nil {
		lt.discard()
		return ctx, nil, nil, s.wrap(fmt.Errorf("reading the record and taking the key's lock: %w", err))
	}
	var rec *idem.Record
	for rows.Next() {
		if rec != nil {
			continue
		}
		if rec, err = scanRecord(rows); err != nil {
			_ = rows.Close()
			lt.discard()
			return ctx, nil, nil, s.wrap(err)
		}
	}
	var expires sql.NullInt64
	locked := rows.Err() == nil && rows.NextResultSet()
	if locked {
		for rows.Next() {
			if err = rows.Scan(&expires); err != nil {
				break
			}
		}
	}
	if err == nil {
		err = rows.Err()
	}
	if cerr := rows.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil && setFailed(err) && !locked:
		// The guard refused (the session is as it was): a live record, or the
		// lock is held elsewhere.
		if rec != nil {
			_ = conn.Close()
			return ctx, &lockedTx{done: true}, rec, nil
		}
		rec, err = scanRecord(conn.QueryRowContext(ctx, live))
		if errors.Is(err, sql.ErrNoRows) {
			_ = conn.Close()
			return ctx, nil, nil, idem.ErrInFlight
		}
		if err != nil {
			lt.discard()
			return ctx, nil, nil, s.wrap(err)
		}
		_ = conn.Close()
		return ctx, &lockedTx{done: true}, rec, nil
	case err != nil:
		lt.discard()
		return ctx, nil, nil, s.wrap(fmt.Errorf("reading the record, taking the key's lock and beginning the transaction: %w", err))
	case !locked || rec != nil:
		lt.discard()
		return ctx, nil, nil, s.wrap(errors.New("the guard did not refuse after the record was read"))
	}
	// The lock is held, autocommit off and the transaction begun: on failure
	// the connection is closed, which frees both.
	lt.ctx = ctx
	switch {
	case !expires.Valid:
	case expires.Int64 <= now.UnixMicro():
		lt.expired = true
	default:
		// Committed between the lock-free read and the lock: read it whole.
		rec, err = scanRecord(conn.QueryRowContext(ctx, read))
		_ = lt.Rollback(ctx)
		if err != nil {
			return ctx, nil, nil, s.wrap(err)
		}
		return ctx, &lockedTx{done: true}, rec, nil
	}
	lt.q = &connQuerier{conn: conn}
	return context.WithValue(ctx, txKey{}, &txn{s: s, st: st, conn: conn, ctx: ctx, locked: lt}), lt, nil, nil
}

// beginSQLTx gives the transaction of beginLockedConn a *sql.Tx, for a
// handler that asks for one (Tx): START TRANSACTION (which commits the
// session's transaction, in which nothing was written yet) and the savepoint
// again. Commit and Rollback then go through it.
func (t *lockedTx) beginSQLTx() (*sql.Tx, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.tx != nil {
		return t.tx, nil
	}
	if t.done {
		return nil, sql.ErrTxDone
	}
	tx, err := t.conn.BeginTx(t.ctx, nil)
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(t.ctx, mark); err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	t.tx = tx
	return tx, nil
}

// readOrLock reads the live record of the key on conn with live, a query without
// any lock. When it finds one it returns it, leaving the session as it was.
// Otherwise it takes the key's lock (lock names it), turns autocommit off and
// sets the next transaction's isolation level, and returns locked. When the lock
// is held elsewhere it reads once more and returns what it finds (nil and not
// locked: idem.ErrInFlight for the caller). On error the caller discards conn.
func (s *Store) readOrLock(ctx context.Context, conn *sql.Conn, st *settings, lock, live string) (rec *idem.Record, locked bool, err error) {
	take := "GET_LOCK(" + lock + ", 0) = 1"
	guard := func(cond string) string {
		return "SET autocommit = IF(" + cond + ", 0, 2), " + s.isolationSQL(st)
	}
	if st.multi && st.foundRows {
		// One round trip: the read, then the guard, which fails (1231) without
		// trying the lock when the read returned a row. (The SET reads no
		// table: a read in the statement that turns autocommit off leaves a
		// transaction open, which START TRANSACTION would end, and with it the
		// isolation level set for the next one.)
		rows, err := conn.QueryContext(ctx, live+"; "+guard("IF(FOUND_ROWS() > 0, 0, "+take+")"))
		if err != nil {
			return nil, false, err
		}
		for rows.Next() {
			if rec != nil {
				continue
			}
			if rec, err = scanRecord(rows); err != nil {
				_ = rows.Close()
				return nil, false, err
			}
		}
		if err := rows.Err(); err != nil {
			_ = rows.Close()
			return nil, false, err
		}
		err = rows.Close() // the guard's outcome
		switch {
		case rec != nil && setFailed(err):
			return rec, false, nil
		case rec != nil:
			// The guard cannot succeed after a row; if it did, the session is not
			// as it was.
			return nil, false, fmt.Errorf("the guard did not refuse after the record was read (%v)", err)
		case err == nil:
			return nil, true, nil
		case !setFailed(err):
			return nil, false, err
		}
	} else {
		rec, err = scanRecord(conn.QueryRowContext(ctx, live))
		if err == nil {
			return rec, false, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return nil, false, err
		}
		_, err = conn.ExecContext(ctx, guard(take))
		if err == nil {
			return nil, true, nil
		}
		if !setFailed(err) {
			return nil, false, fmt.Errorf("turning autocommit off for the transaction: %w", err)
		}
	}
	// The lock is held elsewhere (the session is as it was): by a request that
	// runs, or that has just committed the record.
	rec, err = scanRecord(conn.QueryRowContext(ctx, live))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, false, nil
	}
	return rec, false, err
}

// lockedTx is the idem.LockedTx of the single-transaction flow.
type lockedTx struct {
	s          *Store
	st         *settings
	conn       *sql.Conn
	tx         *sql.Tx
	ctx        context.Context // the context tx is bound to
	lock       string          // SQL expression naming the lock
	now        time.Time
	scope, key string
	expired    bool // BeginLocked found an expired record to replace
	ins        *sql.Stmt

	mu   sync.Mutex
	rec  *lockedRecord // the record Insert was given
	done bool

	// q is what Conn hands the handler in the session's own transaction
	// (beginLockedConn); nil otherwise.
	q *connQuerier
}

// Insert implements idem.LockedTx. It checks rec and keeps it for Commit, which
// writes it (first deleting the record that had expired at the time of
// BeginLocked, if there was one) and commits, or returns idem.ErrInFlight, having
// committed nothing, when a live record appeared since (a claim-then-complete
// request took the key without the lock).
func (t *lockedTx) Insert(ctx context.Context, rec *idem.Record) error {
	if rec.Scope != t.scope || rec.Key != t.key {
		return fmt.Errorf("mysqlstore: Insert of (%q, %q) in the transaction locked for (%q, %q)", rec.Scope, rec.Key, t.scope, t.key)
	}
	if err := checkLengths(rec.Scope, rec.Key, rec.Fingerprint, rec.Token); err != nil {
		return err
	}
	r := &lockedRecord{rec: *rec}
	if resp := rec.Response; resp != nil {
		hdr, err := encodeHeaders(resp.Header)
		if err != nil {
			return err
		}
		if err := checkResponse(resp, hdr); err != nil {
			return err
		}
		if err := t.s.checkPacket(hdr, resp.Body, resp.Ref); err != nil {
			return err
		}
		r.hdr, r.body = hdr, resp.Body
		if r.body != nil && len(r.body) == 0 {
			r.body = []byte{} // stored as '' rather than NULL
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return sql.ErrTxDone
	}
	t.rec = r
	return nil
}

// lockedRecord is the record Insert was given, with its headers encoded.
type lockedRecord struct {
	rec       idem.Record
	hdr, body []byte
}

// inline reports whether the record goes as SQL text (see inlineLimit).
func (r *lockedRecord) inline() bool { return len(r.hdr)+len(r.body) <= inlineLimit }

// args returns the record as lockedInsert's arguments.
func (r *lockedRecord) args() []any {
	rec := &r.rec
	var status sql.NullInt32
	var omitted bool
	var ref []byte
	if resp := rec.Response; resp != nil {
		status = sql.NullInt32{Int32: int32(resp.Status), Valid: true}
		omitted = resp.BodyOmitted
		if resp.Ref != "" {
			ref = []byte(resp.Ref)
		}
	}
	return []any{
		[]byte(rec.Scope), []byte(rec.Key), uint8(rec.State), []byte(rec.Fingerprint), []byte(rec.Token),
		rec.CreatedAt.UnixMicro(), rec.LeaseUntil.UnixMicro(), rec.ExpiresAt.UnixMicro(),
		status, r.hdr, r.body, omitted, ref,
	}
}

// insertSQL is lockedInsert with the record inlined as literals, built in one
// buffer.
func (t *lockedTx) insertSQL() string {
	r := t.rec
	rec := &r.rec
	b := make([]byte, 0, 256+2*(len(rec.Scope)+len(rec.Key)+len(rec.Fingerprint)+len(rec.Token)+len(r.hdr)+len(r.body)))
	b = append(b, "INSERT INTO "...)
	b = append(b, t.s.q.table...)
	b = append(b, " ("+columns+") VALUES ("...)
	b = appendLit(b, rec.Scope, true)
	b = append(b, ", "...)
	b = appendLit(b, rec.Key, true)
	b = append(b, ", "...)
	b = strconv.AppendUint(b, uint64(uint8(rec.State)), 10)
	b = append(b, ", "...)
	b = appendLit(b, rec.Fingerprint, true)
	b = append(b, ", "...)
	b = appendLit(b, rec.Token, true)
	for _, n := range [...]int64{rec.CreatedAt.UnixMicro(), rec.LeaseUntil.UnixMicro(), rec.ExpiresAt.UnixMicro()} {
		b = append(b, ", "...)
		b = strconv.AppendInt(b, n, 10)
	}
	resp := rec.Response
	if resp == nil {
		b = append(b, ", NULL, NULL, NULL, 0, NULL)"...)
		return string(b)
	}
	b = append(b, ", "...)
	b = strconv.AppendInt(b, int64(int32(resp.Status)), 10)
	b = append(b, ", "...)
	b = appendLit(b, r.hdr, r.hdr != nil)
	b = append(b, ", "...)
	b = appendLit(b, r.body, r.body != nil)
	if resp.BodyOmitted {
		b = append(b, ", 1, "...)
	} else {
		b = append(b, ", 0, "...)
	}
	b = appendLit(b, resp.Ref, resp.Ref != "")
	return string(append(b, ')'))
}

// deleteSQL is lockedDelete for the locked key with literals.
func (t *lockedTx) deleteSQL() string {
	return "DELETE FROM " + t.s.q.table + " WHERE `scope` = " + litString(t.scope) + " AND `key` = " + litString(t.key) +
		" AND `expires_at` <= " + litInt(t.now.UnixMicro())
}

// Commit implements idem.LockedTx: it checks that the server has not rolled the
// transaction back (idem.ErrTxAborted, and nothing commits), writes the record
// Insert kept (idem.ErrInFlight, and nothing commits, when a live record
// appeared), commits, releases the lock and returns the connection. The lock is
// released even when the commit fails.
func (t *lockedTx) Commit(ctx context.Context) error {
	defer t.q.end()()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return sql.ErrTxDone
	}
	t.done = true
	// database/sql rolls tx back when its context ends, from a goroutine of its
	// own; a COMMIT sent before that goroutine runs (inside the batch below,
	// which database/sql's own Commit check does not see) would commit a
	// transaction whose context had ended, such as a handler's past
	// HandlerTimeout.
	if t.ctx.Err() != nil {
		return t.fail(errors.Join(sql.ErrTxDone, context.Cause(t.ctx)))
	}
	// First the check, so that an aborted transaction's successor (which holds
	// the locks of the handler's statements after the abort) does not also lock
	// the record.
	stmts := []string{checkMark}
	if t.expired && t.rec != nil {
		stmts = append(stmts, t.deleteSQL())
	}
	inline := t.rec == nil || t.rec.inline()
	if !inline || !t.st.multi {
		// One statement at a time; the record as parameters when large.
		var ex execer = t.conn
		if t.tx != nil {
			ex = t.tx
		}
		if _, _, err := run(ctx, t.st, ex, false, stmts...); err != nil {
			return t.fail(err)
		}
		if t.rec != nil {
			var err error
			switch {
			case inline:
				_, err = ex.ExecContext(ctx, t.insertSQL())
			case t.tx != nil:
				_, err = t.tx.StmtContext(ctx, t.ins).ExecContext(ctx, t.rec.args()...)
			default:
				// The session's own transaction (beginLockedConn): the driver
				// prepares the statement on this connection.
				_, err = t.conn.ExecContext(ctx, t.s.q.lockedInsert, t.rec.args()...)
			}
			if err != nil {
				return t.fail(err)
			}
		}
		var err error
		if t.tx != nil {
			err = t.tx.Commit()
		} else if _, err = t.conn.ExecContext(ctx, "COMMIT"); err != nil && !serverError(err) {
			// The outcome is unknown: close the connection.
			t.discard()
			return fmt.Errorf("mysqlstore: commit: %w", err)
		}
		t.release(err == nil)
		if serverError(err) {
			// The server answered the COMMIT with an error: nothing committed.
			return fmt.Errorf("mysqlstore: commit: the server refused the COMMIT, so nothing was committed (%w): %w", err, idem.ErrTxAborted)
		}
		if err != nil {
			return fmt.Errorf("mysqlstore: commit: %w", err)
		}
		return nil
	}
	if t.rec != nil {
		stmts = append(stmts, t.insertSQL())
	}
	// COMMIT first, then the release: the lock is freed only once the record is
	// committed.
	stmts = append(stmts, "COMMIT", t.releaseSQL())
	var ex execer = t.conn
	if t.tx != nil {
		ex = t.tx
	}
	_, err := ex.ExecContext(ctx, strings.Join(stmts, "; "))
	switch {
	case err == nil:
	case setFailed(err):
		// Committed (only the last statement raises 1231), but the lock was
		// not this session's to release: the connection is closed below.
	case !serverError(err):
		// The outcome is unknown (the connection broke, or ctx ended during
		// the round trip): close the connection, which rolls back whatever did
		// not commit and frees the lock.
		if t.tx != nil {
			_ = t.tx.Rollback()
		}
		t.discard()
		return fmt.Errorf("mysqlstore: commit: %w", err)
	default:
		return t.fail(err)
	}
	if t.tx != nil {
		// The transaction is committed, and the session back in autocommit
		// mode: database/sql's Commit only closes its Tx (a COMMIT with
		// nothing to commit, one more round trip).
		_ = t.tx.Commit()
	}
	if err != nil {
		t.discard()
		return nil
	}
	_ = t.conn.Close()
	return nil
}

// releaseSQL frees the lock and turns autocommit back on (see Store.BeginTx) in
// one statement, which fails, changing nothing, when the lock was not this
// session's.
func (t *lockedTx) releaseSQL() string {
	return "SET autocommit = IF(RELEASE_LOCK(" + t.lock + ") = 1, 1, 2)"
}

// fail ends the transaction after err, a statement of Commit failing before the
// COMMIT: nothing was committed. It rolls back, releases the lock and says what
// happened.
func (t *lockedTx) fail(err error) error {
	t.rollback()
	if code, ok := errorNumber(err); ok && code == 1305 { // ER_SP_DOES_NOT_EXIST
		return errAborted(err)
	}
	if code, ok := errorNumber(err); ok && code == 1062 { // ER_DUP_ENTRY
		return idem.ErrInFlight
	}
	if deadlocked(err) {
		return errAborted(err)
	}
	if serr := t.s.statementLogged(err); serr != nil {
		return serr
	}
	if serverError(err) {
		// The server refused a statement sent before COMMIT, or the COMMIT:
		// it answered, and nothing was committed.
		return fmt.Errorf("%w: %w", t.s.wrap(err), idem.ErrTxAborted)
	}
	return t.s.wrap(err)
}

// Rollback implements idem.LockedTx. It is a no-op after Commit.
func (t *lockedTx) Rollback(context.Context) error {
	defer t.q.end()()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil
	}
	t.done = true
	if err := t.rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("mysqlstore: rollback: %w", err)
	}
	return nil
}

// rollback rolls the transaction back and releases the lock: through the
// *sql.Tx when there is one, else with ROLLBACK and the release in one round
// trip on the connection (closed instead when that fails).
func (t *lockedTx) rollback() error {
	if t.tx != nil {
		err := t.tx.Rollback()
		t.release(err == nil)
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := t.conn.ExecContext(ctx, "ROLLBACK; "+t.releaseSQL()); err != nil {
		t.discard()
		return nil // closing the connection rolled back and freed the lock
	}
	_ = t.conn.Close()
	return nil
}

// release frees the lock and turns autocommit back on (see Store.BeginTx) in one
// statement, which fails, changing nothing, when the lock was not this
// session's; then it returns the connection to the pool. When either cannot be
// confirmed, or when ended is false (see unguard), it closes the connection
// instead, which frees every lock the session holds.
func (t *lockedTx) release(ended bool) {
	if !ended {
		t.discard()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := t.conn.ExecContext(ctx, t.releaseSQL()); err != nil {
		t.discard()
		return
	}
	_ = t.conn.Close()
}

// discard closes the connection rather than returning it to the pool.
func (t *lockedTx) discard() { discard(t.conn) }
