package sqlitestore

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

var (
	_ idem.SingleTxStore = (*Store)(nil)
	_ idem.FlowPreferrer = (*Store)(nil)
)

// PreferredFlow implements idem.FlowPreferrer: idem.FlowAuto runs the
// single-transaction flow on a Store. A first-time request costs one write
// transaction and one commit there, against two commits in the
// claim-then-complete flow; see "Single-transaction flow" in the package
// documentation.
func (s *Store) PreferredFlow() idem.Flow { return idem.FlowSingleTx }

// recordKey identifies a record among the stores on one *sql.DB.
type recordKey struct{ table, scope, key string }

// busyKeys are the keys of the single-flow transactions in progress on one
// *sql.DB, in every Store on it.
type busyKeys struct {
	mu sync.Mutex
	m  map[recordKey]struct{}
}

func (b *busyKeys) tryAdd(k recordKey) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.m[k]; ok {
		return false
	}
	if b.m == nil {
		b.m = make(map[recordKey]struct{})
	}
	b.m[k] = struct{}{}
	return true
}

func (b *busyKeys) remove(k recordKey) {
	b.mu.Lock()
	delete(b.m, k)
	b.mu.Unlock()
}

// BeginLocked implements idem.SingleTxStore (idem.FlowSingleTx). SQLite has no
// lock per key; the transaction's write lock covers the whole database, so:
//
//   - BeginLocked first reads the record without any lock. A live record (a
//     replay, a 409 or a 422 for the middleware) is returned at once with a
//     LockedTx that holds nothing: those answers never wait for the write lock.
//   - When a Store on the same *sql.DB already runs a single-flow transaction
//     for (scope, key), BeginLocked returns idem.ErrInFlight at once (the
//     middleware answers 409).
//   - Otherwise it waits for the write lock like BeginTx (Config.LockTimeout in
//     this process, the busy timeout behind another process) and reads the
//     record again, in the transaction and in the statement that takes the
//     lock. A record written meanwhile (by another process, say) is returned
//     and the transaction rolled back; a request for the same key in another
//     process thus waits for that process's transaction and then finds its
//     complete record (a replay), rather than a 409.
//
// Nothing is written before Insert: a crash rolls everything back, and the retry
// runs at once.
func (s *Store) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	n := nanos(now)
	r, err := s.read(ctx, scope, key, true, n)
	if err != nil {
		return ctx, nil, nil, wrap("begin locked: read record", err)
	}
	if r != nil {
		rec, err := r.record(scope, key)
		if err != nil {
			return ctx, nil, nil, err
		}
		return ctx, noTx{}, rec, nil
	}
	k := recordKey{s.table, scope, key}
	if !s.busy.tryAdd(k) {
		return ctx, nil, nil, idem.ErrInFlight
	}
	lt := &lockedTx{now: n, key: k}
	t := &lt.storeTx
	if err := s.begin(ctx, t); err != nil {
		s.busy.remove(k)
		return ctx, nil, nil, wrap("begin locked", err)
	}
	// The write lock is held once the first statement ran: the transaction's
	// statements never wait, so they need no cancellation (which costs the
	// driver a goroutine per statement); database/sql still ends the
	// transaction when ctx ends.
	sctx := context.WithoutCancel(ctx)
	live, err := t.exec(sctx, stmtLockLive, scope, key, n)
	if err == nil && live > 0 {
		// Written since the first read (by another process, say): read it under
		// the lock.
		var st *sql.Stmt
		if st, err = s.stmt(sctx, stmtGetLive, t.tx); err == nil {
			r, err = scanRow(st.QueryRowContext(sctx, scope, key, n))
		}
	}
	if err != nil {
		_ = lt.Rollback(ctx)
		return ctx, nil, nil, wrap("begin locked: take the write lock and read the record", err)
	}
	if r != nil {
		_ = lt.Rollback(ctx)
		rec, err := r.record(scope, key)
		if err != nil {
			return ctx, nil, nil, err
		}
		return ctx, noTx{}, rec, nil
	}
	return context.WithValue(ctx, txKey{}, t), lt, nil, nil
}

// noTx is the LockedTx of a BeginLocked that found a live record: it holds no
// transaction, and the middleware only rolls it back. Insert writes nothing and
// reports the live record as idem.ErrInFlight, as a lockedTx would.
type noTx struct{}

var errNoTx = fmt.Errorf("%w (BeginLocked found a live record, so there is no transaction to write in)", idem.ErrInFlight)

func (noTx) Insert(context.Context, *idem.Record) error { return wrap("insert", errNoTx) }
func (noTx) Commit(context.Context) error               { return nil }
func (noTx) Rollback(context.Context) error             { return nil }

// lockedTx is the idem.LockedTx of a Store.
type lockedTx struct {
	storeTx
	now      int64     // BeginLocked's clock reading, in Unix nanoseconds
	key      recordKey // in the Store's busyKeys until released
	released atomic.Bool
}

// release removes the transaction's key from busyKeys, once.
func (t *lockedTx) release() {
	if t.released.CompareAndSwap(false, true) {
		t.s.busy.remove(t.key)
	}
}

// Insert implements idem.LockedTx: it writes rec, complete, replacing a record
// that was expired at BeginLocked's clock reading. It returns idem.ErrInFlight
// when a live record appeared meanwhile (impossible while the write lock is held,
// checked all the same).
func (t *lockedTx) Insert(ctx context.Context, rec *idem.Record) error {
	if rec == nil || rec.Response == nil {
		return wrap("insert", errNilResponse)
	}
	headers, body, ref, err := encodeResponse(rec.Response)
	if err != nil {
		return wrap("insert", err)
	}
	// Under the write lock the statement never waits: no cancellation needed.
	n, err := t.exec(context.WithoutCancel(ctx), stmtInsert, rec.Scope, rec.Key, int64(rec.State), rec.Fingerprint, rec.Token,
		nanos(rec.CreatedAt), nanos(rec.LeaseUntil), nanos(rec.ExpiresAt),
		int64(rec.Response.Status), headers, body, rec.Response.BodyOmitted, ref, t.now)
	if err != nil {
		return wrap("insert", err)
	}
	if n == 0 {
		return idem.ErrInFlight
	}
	return nil
}

// Commit implements idem.LockedTx.
func (t *lockedTx) Commit(ctx context.Context) error {
	defer t.release()
	return t.storeTx.Commit(ctx)
}

// Rollback implements idem.LockedTx. It is safe after Commit.
func (t *lockedTx) Rollback(ctx context.Context) error {
	defer t.release()
	return t.storeTx.Rollback(ctx)
}
