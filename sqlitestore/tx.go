package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

type txKey struct{}

// Tx returns the transaction the idem middleware opened for this request, or nil
// outside one. A handler writes its business rows through it, so that they commit
// together with the stored response, or not at all:
//
//	tx := sqlitestore.Tx(r.Context())
//	res, err := tx.ExecContext(r.Context(), "INSERT INTO orders (item) VALUES (?)", item)
//
// Do not Commit or Rollback it: the middleware does, after storing the response.
// A *sql.Tx cannot refuse either, and what follows when a handler ends the
// transaction itself breaks the one-transaction guarantee: after Rollback (or
// an error the handler ignores that rolled it back) nothing commits and the key
// is released, as it should; after Commit the handler's writes are committed
// but the middleware cannot store the response with them, so the key is
// released and a retry runs the operation again; after COMMIT or ROLLBACK sent
// as SQL the response is stored on its own, replayed even when ROLLBACK undid
// the writes it reports. Use SAVEPOINT, RELEASE and ROLLBACK TO for partial
// rollbacks instead.
// Read through it too (a read through the *sql.DB does not see the transaction's
// writes), and never write through the *sql.DB meanwhile: the transaction holds
// the database's only write lock, so that write would wait for it and fail after
// the busy timeout.
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := ctx.Value(txKey{}).(*storeTx)
	if tx == nil {
		return nil
	}
	return tx.tx
}

// BeginTx implements idem.TxStore. The transaction takes SQLite's write lock when
// it begins (whatever BEGIN mode the driver uses) and holds it until Commit or
// Rollback, one of which must be called. The returned context carries it for Tx.
func (s *Store) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	t := &storeTx{}
	if err := s.begin(ctx, t); err != nil {
		return ctx, nil, wrap("begin transaction", err)
	}
	// With a deferred BEGIN, this statement takes the write lock, waiting for
	// another process's under the busy timeout; it needs no cancellation beyond
	// that bound (which would cost the driver a goroutine per statement).
	if _, err := t.exec(context.WithoutCancel(ctx), stmtLock); err != nil {
		_ = t.Rollback(ctx)
		return ctx, nil, wrap("begin transaction: take the write lock", err)
	}
	return context.WithValue(ctx, txKey{}, t), t, nil
}

// begin waits for the gate and begins transaction t, bound to ctx: it is rolled
// back when ctx ends. With embedded.Open's BEGIN IMMEDIATE it holds the write
// lock already; with another driver, the caller's first statement must be a
// write.
//
// database/sql gets ctx without its cancellation, and the rollback when ctx ends
// is arranged here (context.AfterFunc), as database/sql would: given a context
// that can end, modernc.org/sqlite would start a goroutine watching it during
// BEGIN and another during COMMIT. BEGIN waits only for another process's write
// lock (this process's writers queue in the gate), which the busy timeout
// bounds; a COMMIT in WAL mode waits for nothing.
func (s *Store) begin(ctx context.Context, t *storeTx) error {
	if err := s.warm(ctx); err != nil {
		return err
	}
	if err := s.gate.acquire(ctx, s.lockTimeout); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		s.gate.unlock()
		return err
	}
	tx, err := s.db.BeginTx(context.WithoutCancel(ctx), nil)
	if err != nil {
		s.gate.unlock()
		return err
	}
	t.s, t.tx = s, tx
	if ctx.Done() != nil {
		t.ctx = ctx
		t.stop = context.AfterFunc(ctx, func() { _ = tx.Rollback() })
	}
	return nil
}

// exec runs statement id in the transaction and returns the number of rows it
// changed (or matched, for an UPDATE).
func (t *storeTx) exec(ctx context.Context, id stmtID, args ...any) (int64, error) {
	st, err := t.s.stmt(ctx, id, t.tx)
	if err != nil {
		return 0, err
	}
	res, err := st.ExecContext(ctx, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// storeTx is the idem.Tx of a Store.
type storeTx struct {
	s     *Store
	tx    *sql.Tx
	ended atomic.Bool
	ctx   context.Context // the context the transaction is bound to; nil when it cannot end
	stop  func() bool     // stops the rollback when the context ends; nil when it cannot end
}

// done opens the gate, once.
func (t *storeTx) done() {
	if t.ended.CompareAndSwap(false, true) {
		if t.stop != nil {
			t.stop()
		}
		t.s.gate.unlock()
	}
}

// Complete implements idem.Tx: the fenced completion, inside the transaction.
func (t *storeTx) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	// Under the write lock the statement never waits: no cancellation needed.
	return t.s.complete(context.WithoutCancel(ctx), t.tx, scope, key, token, resp, expiresAt)
}

// Commit implements idem.Tx. Once the transaction's context has ended it
// rolls back and fails, as database/sql's Commit does: the rollback that
// context.AfterFunc starts runs on a goroutine of its own, and a COMMIT sent
// before it would otherwise commit a transaction whose context had ended.
func (t *storeTx) Commit(context.Context) error {
	defer t.done()
	if t.ctx != nil {
		if err := t.ctx.Err(); err != nil {
			_ = t.tx.Rollback()
			return wrap("commit", err)
		}
	}
	if err := t.tx.Commit(); err != nil {
		if errors.Is(err, sql.ErrTxDone) {
			return wrap("commit", err)
		}
		// SQLite answered the COMMIT with an error (a deferred foreign key, a
		// full disk): the database is in this process, so no answer is ever
		// lost, and a COMMIT that failed committed nothing (the driver rolls
		// back a transaction SQLite left open).
		return fmt.Errorf("sqlitestore: commit: SQLite refused the COMMIT, so nothing was committed (%w): %w", err, idem.ErrTxAborted)
	}
	return nil
}

// Rollback implements idem.Tx. After Commit, or after database/sql rolled the
// transaction back because its context ended, it does nothing and returns nil.
func (t *storeTx) Rollback(context.Context) error {
	defer t.done()
	if err := t.tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return wrap("rollback", err)
	}
	return nil
}
