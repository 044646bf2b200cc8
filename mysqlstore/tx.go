package mysqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/idemkit/idem"
)

type txKey struct{}

// Tx returns the transaction the idem middleware opened for the request whose
// context is ctx, or nil outside one. A handler does its business writes in it, so
// that they commit together with the stored response, or not at all:
//
//	tx := mysqlstore.Tx(r.Context())
//	_, err := tx.ExecContext(r.Context(), "INSERT INTO orders (item) VALUES (?)", item)
//
// The handler must not Commit or Rollback it; the middleware does.
func Tx(ctx context.Context) *sql.Tx {
	t, _ := ctx.Value(txKey{}).(*txn)
	if t == nil {
		return nil
	}
	return t.tx
}

// BeginTx implements idem.TxStore. It begins a READ COMMITTED transaction and
// returns a context that carries it (see Tx). READ COMMITTED because the fencing
// does not need more: the completion is an UPDATE, a current read that sees the
// latest committed token under any isolation level; and it takes no gap locks on
// the handler's tables during ordinary reads and updates, so concurrent requests
// block and deadlock less than under InnoDB's default REPEATABLE READ. A handler
// that needs a consistent snapshot across several reads can lock what it reads
// (SELECT … FOR UPDATE or FOR SHARE).
//
// The transaction is bound to ctx: database/sql rolls it back when ctx ends, which
// happens when the client goes away or the middleware finds the lease lost.
func (s *Store) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return ctx, nil, s.wrap(err)
	}
	t := &txn{s: s, tx: tx, ctx: ctx}
	return context.WithValue(ctx, txKey{}, t), t, nil
}

// txn is the idem.Tx of a Store.
type txn struct {
	s   *Store
	tx  *sql.Tx
	ctx context.Context // the context the transaction is bound to
}

// Complete implements idem.Tx: the fenced UPDATE, inside the transaction.
func (t *txn) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	args, err := completeArgs(scope, key, token, resp, expiresAt)
	if err != nil {
		return err
	}
	// Use the statement Claim prepared; never prepare one here, which would need a
	// second connection while this transaction holds one.
	var res sql.Result
	if st := t.s.cached(t.s.q.complete); st != nil {
		res, err = t.tx.StmtContext(ctx, st).ExecContext(ctx, args...)
	} else {
		res, err = t.tx.ExecContext(ctx, t.s.q.complete, args...)
	}
	if err != nil {
		return t.explain(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return t.explain(err)
	}
	if n == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// Commit implements idem.Tx.
func (t *txn) Commit(context.Context) error {
	return t.explain(t.tx.Commit())
}

// Rollback implements idem.Tx. It is a no-op after Commit or an earlier Rollback.
func (t *txn) Rollback(context.Context) error {
	err := t.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return t.explain(err)
}

// explain wraps err; when the transaction died because its context ended, it says
// why (for example idem.ErrLockLost, the cause the middleware cancels with).
func (t *txn) explain(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, sql.ErrTxDone) && t.ctx.Err() != nil {
		return errors.Join(t.s.wrap(err), context.Cause(t.ctx))
	}
	return t.s.wrap(err)
}
