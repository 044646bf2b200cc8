package pgstore

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

type txKey struct{}

// Tx returns the transaction the middleware opened for the request whose context
// is ctx, or nil outside one. A handler does its business writes in it; the
// middleware stores the response in the same transaction and commits it, so the
// handler must not call Commit or Rollback itself.
//
// Tx is nil when the request is not keyed (no Idempotency-Key on an optional
// route, a method that is not keyed): such a handler opens its own transaction.
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

// BeginTx implements idem.TxStore: it begins a transaction on a connection of the
// pool and returns a context that carries it (read it with Tx).
//
// The completion costs no round trip of its own: Complete only prepares the fenced
// UPDATE, and Commit sends it together with COMMIT in one pipelined batch. When the
// fence does not match, the UPDATE aborts the transaction, nothing is committed,
// and Commit returns idem.ErrLockLost.
func (s *Store) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return ctx, nil, s.wrap("begin transaction", err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		conn.Release()
		return ctx, nil, s.wrap("begin transaction", err)
	}
	return context.WithValue(ctx, txKey{}, tx), &claimTx{s: s, conn: conn, tx: tx}, nil
}

// claimTx is the idem.Tx of the claim-then-complete flow.
type claimTx struct {
	s    *Store
	conn *pgxpool.Conn // nil once the transaction ended and the connection went back
	tx   pgx.Tx
	// completion holds the arguments of the fenced UPDATE that Commit sends.
	completion []any
}

// Complete prepares the fenced completion; Commit sends it.
func (t *claimTx) Complete(_ context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	args, err := completeArgs(scope, key, token, resp, expiresAt)
	if err != nil {
		return err
	}
	t.completion = args
	return nil
}

// Commit sends the prepared completion and COMMIT in one round trip.
func (t *claimTx) Commit(ctx context.Context) error {
	return t.s.commitWith(ctx, &t.conn, t.tx, "complete", t.s.completeAndCommitSQL, t.completion, idem.ErrLockLost)
}

// commitWith commits tx, the transaction on *conn. When args is nil it is a plain
// COMMIT. Otherwise it sends stmt (a statement that raises division_by_zero when
// its write matched no row) and COMMIT in one pipelined batch, and returns
// fenceErr, having committed nothing, when stmt raised. Once the transaction has
// ended, the connection goes back to the pool and *conn becomes nil; when it is
// still open (aborted), it is left to Rollback.
//
// The pgx.Tx handed to the handler is abandoned with its connection back in the
// pool: handlers must not use it after they return.
func (s *Store) commitWith(ctx context.Context, conn **pgxpool.Conn, tx pgx.Tx, op, stmt string, args []any, fenceErr error) error {
	c := *conn
	if c == nil {
		return pgx.ErrTxClosed
	}
	release := func() {
		c.Release()
		*conn = nil
	}
	if args == nil {
		err := tx.Commit(ctx)
		release()
		if err != nil {
			return fmt.Errorf("pgstore: commit: %w", err)
		}
		return nil
	}
	b := &pgx.Batch{}
	b.Queue(stmt, args...)
	b.Queue("commit")
	br := c.Conn().SendBatch(ctx, b)
	_, stmtErr := br.Exec()
	_, commitErr := br.Exec()
	closeErr := br.Close()
	if c.Conn().PgConn().TxStatus() != 'I' {
		// The transaction is still open (aborted by stmt or by an error): leave it
		// to Rollback.
		switch {
		case isDivisionByZero(stmtErr):
			return fenceErr
		case stmtErr != nil:
			return s.wrap(op, stmtErr)
		case commitErr != nil:
			return fmt.Errorf("pgstore: commit: %w", commitErr)
		case closeErr != nil:
			return fmt.Errorf("pgstore: commit: %w", closeErr)
		}
		return errors.New("pgstore: commit: the transaction is still open after COMMIT")
	}
	// The connection is idle again: the transaction ended (committed, unless the
	// batch reports an error).
	release()
	if err := errors.Join(stmtErr, commitErr, closeErr); err != nil {
		if isDivisionByZero(stmtErr) {
			return fenceErr
		}
		return fmt.Errorf("pgstore: commit: %w", err)
	}
	return nil
}

// Rollback aborts the transaction; a no-op after Commit.
func (t *claimTx) Rollback(ctx context.Context) error { return rollback(ctx, &t.conn, t.tx) }

// rollback aborts tx, the transaction on *conn, and hands the connection back to
// the pool (which closes it instead when a transaction is still open on it). It
// is a no-op once *conn is nil.
func rollback(ctx context.Context, conn **pgxpool.Conn, tx pgx.Tx) error {
	if *conn == nil {
		return nil
	}
	err := tx.Rollback(ctx)
	(*conn).Release()
	*conn = nil
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return fmt.Errorf("pgstore: rollback: %w", err)
	}
	return nil
}

// isDivisionByZero reports whether err is the error completeAndCommitSQL raises
// when its fence matched no row.
func isDivisionByZero(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "22012"
}

// lockKey is the 64-bit advisory lock key of (scope, key) in this store's table.
func (s *Store) lockKey(scope, key string) int64 {
	h := sha256.New()
	var n [8]byte
	for _, part := range [][]byte{s.lockNS, []byte(scope), []byte(key)} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return int64(binary.BigEndian.Uint64(h.Sum(nil)))
}

// BeginLocked implements idem.SingleTxStore. It sends BEGIN, the advisory lock
// and the record lookup in one pipelined round trip (pgx.Batch.BeginTx).
//
// The lock is tried only when no live record exists: a live record answers the
// request (replay, 409 or 422) without the lock, so concurrent retries of a
// completed key replay in parallel instead of turning each other away with 409.
func (s *Store) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	for range maxClaimRounds {
		ctx, tx, rec, err := s.beginLocked(ctx, scope, key, now)
		if !errors.Is(err, errVanished) {
			return ctx, tx, rec, err
		}
	}
	return ctx, nil, nil, idem.ErrInFlight
}

// errVanished: the live record that made beginLocked skip the lock was gone
// when it was read.
var errVanished = errors.New("record vanished")

func (s *Store) beginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(s.lockSQL, s.lockKey(scope, key), []byte(scope), []byte(key), now)
	b.Queue(s.getSQL, []byte(scope), []byte(key), now)
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return ctx, nil, nil, s.wrap("begin locked transaction", err)
	}
	br := conn.Conn().SendBatch(ctx, b)
	tx := br.Tx()
	var locked, tried bool
	rec := scanRecord{Record: &idem.Record{Scope: scope, Key: key}}
	_, err = br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(&locked)
		tried = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil // a live record exists: the lock was not tried
		}
	}
	found := false
	if err == nil {
		err = br.QueryRow().Scan(rec.scanTargets()...)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && found {
		err = rec.finish()
	}
	switch {
	case err != nil:
		err = s.wrap("begin locked transaction", err)
	case tried && !locked:
		err = idem.ErrInFlight
	case !tried && !found:
		err = errVanished
	}
	if err != nil {
		_ = rollback(context.WithoutCancel(ctx), &conn, tx)
		return ctx, nil, nil, err
	}
	var out *idem.Record
	if found {
		out = rec.Record
	}
	return context.WithValue(ctx, txKey{}, tx), &lockedTx{s: s, conn: conn, tx: tx, now: now}, out, nil
}

// lockedTx is the idem.LockedTx of the single-transaction flow.
type lockedTx struct {
	s    *Store
	conn *pgxpool.Conn // nil once the transaction ended and the connection went back
	tx   pgx.Tx
	now  time.Time // the clock reading BeginLocked judged expiry by
	// insert holds the arguments of the record insert that Commit sends.
	insert []any
}

// Insert prepares the insert of rec, which replaces a record that expired at the
// time of BeginLocked; Commit sends it together with COMMIT in one round trip,
// and returns idem.ErrInFlight, committing nothing, when a live record holds the
// key (a claim-then-complete request claimed it after the lookup).
func (t *lockedTx) Insert(_ context.Context, rec *idem.Record) error {
	var (
		status  *int32
		hdr     []byte
		body    []byte
		omitted bool
		ref     []byte
		err     error
	)
	if r := rec.Response; r != nil {
		st := int32(r.Status)
		status = &st
		if hdr, err = encodeHeaders(r.Header); err != nil {
			return err
		}
		body, omitted, ref = nullableBytes(r.Body, !r.BodyOmitted), r.BodyOmitted, refBytes(r.Ref)
	}
	t.insert = []any{[]byte(rec.Scope), []byte(rec.Key), int16(rec.State),
		[]byte(rec.Fingerprint), rec.Token, rec.CreatedAt, rec.LeaseUntil, rec.ExpiresAt,
		status, hdr, body, omitted, ref, t.now}
	return nil
}

// Commit sends the prepared insert and COMMIT in one round trip; the lock goes
// with the transaction.
func (t *lockedTx) Commit(ctx context.Context) error {
	return t.s.commitWith(ctx, &t.conn, t.tx, "insert record", t.s.insertAndCommitSQL, t.insert, idem.ErrInFlight)
}

// Rollback aborts the transaction and frees the lock; a no-op after Commit.
func (t *lockedTx) Rollback(ctx context.Context) error { return rollback(ctx, &t.conn, t.tx) }
