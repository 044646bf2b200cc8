package sqlitestore

import (
	"context"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

var _ idem.SingleTxStore = (*Store)(nil)

// recordKey identifies a record.
type recordKey struct{ scope, key string }

// busyKeys are the keys of this Store's single-flow transactions in progress.
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
//   - When this Store already runs a single-flow transaction for (scope, key),
//     BeginLocked returns idem.ErrInFlight at once (the middleware answers 409).
//   - Otherwise it waits for the write lock like BeginTx (Config.LockTimeout in
//     this process, the busy timeout behind another process), then reads the
//     record. A request for the same key in another process thus waits for that
//     process's transaction and then finds its complete record (a replay), rather
//     than a 409.
//
// Nothing is written before Insert: a crash rolls everything back, and the retry
// runs at once.
func (s *Store) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	k := recordKey{scope, key}
	if !s.busy.tryAdd(k) {
		return ctx, nil, nil, idem.ErrInFlight
	}
	tctx, itx, err := s.BeginTx(ctx)
	if err != nil {
		s.busy.remove(k)
		return ctx, nil, nil, err
	}
	t := itx.(*storeTx)
	lt := &lockedTx{storeTx: t, now: nanos(now), release: func() { s.busy.remove(k) }}
	st, err := s.stmt(ctx, stmtGetLive, t.tx)
	if err != nil {
		_ = lt.Rollback(ctx)
		return ctx, nil, nil, wrap("begin locked: read record", err)
	}
	r, err := scanRow(st.QueryRowContext(ctx, scope, key, lt.now))
	if err != nil {
		_ = lt.Rollback(ctx)
		return ctx, nil, nil, wrap("begin locked: read record", err)
	}
	var rec *idem.Record
	if r != nil {
		if rec, err = r.record(scope, key); err != nil {
			_ = lt.Rollback(ctx)
			return ctx, nil, nil, err
		}
	}
	return tctx, lt, rec, nil
}

// lockedTx is the idem.LockedTx of a Store.
type lockedTx struct {
	*storeTx
	now     int64 // BeginLocked's clock reading, in Unix nanoseconds
	once    sync.Once
	release func()
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
	st, err := t.s.stmt(ctx, stmtInsert, t.tx)
	if err != nil {
		return wrap("insert", err)
	}
	res, err := st.ExecContext(ctx, rec.Scope, rec.Key, int64(rec.State), rec.Fingerprint, rec.Token,
		nanos(rec.CreatedAt), nanos(rec.LeaseUntil), nanos(rec.ExpiresAt),
		rec.Response.Status, headers, body, rec.Response.BodyOmitted, ref, t.now)
	if err != nil {
		return wrap("insert", err)
	}
	n, err := res.RowsAffected()
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
	defer t.once.Do(t.release)
	return t.storeTx.Commit(ctx)
}

// Rollback implements idem.LockedTx. It is safe after Commit.
func (t *lockedTx) Rollback(ctx context.Context) error {
	defer t.once.Do(t.release)
	return t.storeTx.Rollback(ctx)
}
