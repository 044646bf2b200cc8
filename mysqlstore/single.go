package mysqlstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
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

// BeginLocked implements idem.SingleTxStore. On one connection taken from the pool
// for the whole request, it takes the named lock of (scope, key) with GET_LOCK
// without waiting (idem.ErrInFlight when another session holds it), begins a READ
// COMMITTED transaction and reads the record. rec is nil when there is none or it
// expired at now.
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
	// Prepare before taking a connection: preparing needs one of its own.
	var stmts [3]*sql.Stmt
	for i, q := range []string{s.q.lockedRead, s.q.lockedDelete, s.q.lockedInsert} {
		st, err := s.stmt(ctx, q)
		if err != nil {
			return ctx, nil, nil, err
		}
		stmts[i] = st
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return ctx, nil, nil, s.wrap(err)
	}
	lt := &lockedTx{s: s, conn: conn, lock: s.lockExpr(scope, key), now: now, scope: scope, key: key,
		read: stmts[0], del: stmts[1], ins: stmts[2]}
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK("+lt.lock+", 0)").Scan(&got); err != nil {
		lt.discard()
		return ctx, nil, nil, s.wrap(fmt.Errorf("taking the key's lock: %w", err))
	}
	if !got.Valid || got.Int64 != 1 {
		_ = conn.Close()
		return ctx, nil, nil, idem.ErrInFlight
	}
	lt.tx, err = s.beginOn(ctx, conn)
	if err != nil {
		lt.release()
		return ctx, nil, nil, err
	}
	rec, err := scanRecord(lt.tx.StmtContext(ctx, lt.read).QueryRowContext(ctx, []byte(scope), []byte(key)))
	switch {
	case errors.Is(err, sql.ErrNoRows):
		rec = nil
	case err != nil:
		_ = lt.Rollback(ctx)
		return ctx, nil, nil, s.wrap(err)
	case rec.ExpiresAt.UnixMicro() <= now.UnixMicro():
		lt.expired, rec = true, nil
	}
	return context.WithValue(ctx, txKey{}, &txn{s: s, tx: lt.tx, ctx: ctx}), lt, rec, nil
}

// lockedTx is the idem.LockedTx of the single-transaction flow.
type lockedTx struct {
	s              *Store
	conn           *sql.Conn
	tx             *sql.Tx
	lock           string // SQL expression naming the lock
	now            time.Time
	scope, key     string
	expired        bool // BeginLocked found an expired record to replace
	read, del, ins *sql.Stmt

	mu      sync.Mutex
	checked bool // the savepoint was released: the transaction was open then
	done    bool
}

// Insert implements idem.LockedTx. It writes rec, first deleting the record that
// had expired at the time of BeginLocked, if there was one. It returns
// idem.ErrInFlight when a live record appeared since (a claim-then-complete request
// took the key without the lock).
func (t *lockedTx) Insert(ctx context.Context, rec *idem.Record) error {
	if rec.Scope != t.scope || rec.Key != t.key {
		return fmt.Errorf("mysqlstore: Insert of (%q, %q) in the transaction locked for (%q, %q)", rec.Scope, rec.Key, t.scope, t.key)
	}
	if err := checkLengths(rec.Scope, rec.Key, rec.Fingerprint, rec.Token); err != nil {
		return err
	}
	var (
		status  sql.NullInt32
		hdr     []byte
		body    []byte
		omitted bool
		ref     []byte
	)
	if r := rec.Response; r != nil {
		args, err := completeArgs(rec.Scope, rec.Key, rec.Token, r, rec.ExpiresAt)
		if err != nil {
			return err
		}
		status = sql.NullInt32{Int32: int32(r.Status), Valid: true}
		hdr, body, omitted, ref = args[1].([]byte), args[2].([]byte), r.BodyOmitted, args[4].([]byte)
	}
	// First the check that the server has not rolled the transaction back.
	t.mu.Lock()
	if !t.checked {
		if err := t.s.checkOpen(ctx, t.tx); err != nil {
			t.mu.Unlock()
			return err
		}
		t.checked = true
	}
	t.mu.Unlock()
	if t.expired {
		if _, err := t.tx.StmtContext(ctx, t.del).ExecContext(ctx, []byte(rec.Scope), []byte(rec.Key), t.now.UnixMicro()); err != nil {
			if deadlocked(err) {
				return errAborted(err)
			}
			return t.s.wrap(err)
		}
	}
	_, err := t.tx.StmtContext(ctx, t.ins).ExecContext(ctx,
		[]byte(rec.Scope), []byte(rec.Key), uint8(rec.State), []byte(rec.Fingerprint), []byte(rec.Token),
		rec.CreatedAt.UnixMicro(), rec.LeaseUntil.UnixMicro(), rec.ExpiresAt.UnixMicro(),
		status, hdr, body, omitted, ref)
	if code, ok := errorNumber(err); ok && code == 1062 { // ER_DUP_ENTRY
		return idem.ErrInFlight
	}
	if deadlocked(err) {
		return errAborted(err)
	}
	if serr := t.s.statementLogged(err); serr != nil {
		return serr
	}
	if err != nil {
		return t.s.wrap(err)
	}
	return nil
}

// Commit implements idem.LockedTx: it commits, then releases the lock, and
// returns the connection. The lock is released even when the commit fails.
// Without a successful Insert before it, it first checks that the server has not
// rolled the transaction back (idem.ErrTxAborted, and nothing commits).
func (t *lockedTx) Commit(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return sql.ErrTxDone
	}
	t.done = true
	if !t.checked {
		if err := t.s.checkOpen(ctx, t.tx); err != nil {
			_ = t.tx.Rollback()
			t.release()
			return err
		}
	}
	err := t.tx.Commit()
	t.release()
	if err != nil {
		return fmt.Errorf("mysqlstore: commit: %w", err)
	}
	return nil
}

// Rollback implements idem.LockedTx. It is a no-op after Commit.
func (t *lockedTx) Rollback(context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil
	}
	t.done = true
	err := t.tx.Rollback()
	t.release()
	if err != nil && !errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("mysqlstore: rollback: %w", err)
	}
	return nil
}

// release frees the lock, turns autocommit back on (see Store.BeginTx) and returns the connection to the pool; when either cannot be
// confirmed, it closes the connection instead, which frees every lock the
// session holds.
func (t *lockedTx) release() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var released sql.NullInt64
	if err := t.conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK("+t.lock+")").Scan(&released); err != nil || released.Int64 != 1 {
		t.discard()
		return
	}
	unguard(ctx, t.conn)
}

// discard closes the connection rather than returning it to the pool.
func (t *lockedTx) discard() { discard(t.conn) }
