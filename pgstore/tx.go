package pgstore

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore/internal/deadsession"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

type txKey struct{}

// Tx returns the transaction the middleware opened for the request whose context
// is ctx, or nil outside one. A handler does its business writes in it; the
// middleware stores the response in the same transaction and commits it.
//
// The handler does not commit it: Commit on it commits nothing and returns an
// error (Begin a savepoint to commit or roll back part of the work). Rollback
// rolls it back; none of the handler's writes commit then, and the middleware
// keeps the handler's answer only if it is an error answer (see
// idem.ErrTxAborted). The same happens when a statement fails and PostgreSQL
// aborts the transaction: to carry on after an expected error (a unique
// violation answered 409), run the statement in a savepoint (tx.Begin).
//
// Once the transaction is over (committed by the middleware, rolled back, or
// ended by a COMMIT or ROLLBACK sent as SQL) every method of the Tx returns
// pgx.ErrTxClosed; a handler must not keep it past its return. Conn and
// LargeObjects are not guarded: do not use them after the handler returned.
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
//
// When ctx is the context of a request idem claimed (idem.KeyFrom) and the
// transaction runs at REPEATABLE READ or SERIALIZABLE — the session's default
// (default_transaction_isolation, read once per connection), or set by the
// handler with SET TRANSACTION on Tx — the transaction's session holds the
// key's advisory lock until it ends (the unlock goes with COMMIT). While it
// does, the lease renewals leave the record's row alone (Extend), and no other
// request can take the key over or the janitor delete it: the lock proves the
// handler alive, and a stalled one is taken over only once its session ends
// (HandlerTimeout ends its transaction). Renewals that wrote the row would make
// the completion fail at those levels, whose snapshot predates them ("could
// not serialize access due to concurrent update"). The lock is taken before
// BEGIN, in the same round trip, so that the handler's first statement still
// starts the transaction. At READ COMMITTED nothing changes: renewals write
// the lease, and a lapsed one is taken over.
func (s *Store) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	for tries := 0; ; tries++ {
		tctx, tx, err, dead := s.beginTx(ctx)
		if !dead || !s.retryDead(ctx, err, tries) {
			return tctx, tx, err
		}
		// The session had ended before it read BEGIN: try another one.
	}
}

// beginTx is one try of BeginTx. dead tells that err is the answer to the
// connection's first statement, on which deadsession.Is tells whether the
// session was dead.
func (s *Store) beginTx(ctx context.Context) (_ context.Context, _ idem.Tx, err error, dead bool) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return ctx, nil, s.wrap("begin transaction", err), false
	}
	lock := &sessionLock{}
	var opts pgx.TxOptions
	if scope, key, keyed := idem.KeyFrom(ctx); keyed {
		lock.keyed, lock.key = true, s.lockKey(scope, key)
		snapshots, err := snapshotIsolation(ctx, conn.Conn())
		if err != nil {
			conn.Release()
			return ctx, nil, s.wrap("begin transaction: read default_transaction_isolation", err), true
		}
		if snapshots {
			// The COMMIT ends the implicit transaction the lock ran in, so that
			// BEGIN starts one in which nothing has run yet.
			opts.BeginQuery = lock.sql() + "; COMMIT; BEGIN"
			lock.held = true
		}
	}
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		// pgx closed the connection, and its session's lock with it.
		conn.Release()
		return ctx, nil, s.wrap("begin transaction", err), true
	}
	htx := newHandlerTx(tx)
	htx.g.lock = lock
	return context.WithValue(ctx, txKey{}, pgx.Tx(htx)), &claimTx{txEnd: txEnd{s: s, conn: conn, htx: htx, ctx: ctx, lock: lock}}, nil, false
}

// sessionLock is the key's advisory lock that a claim-then-complete
// transaction's session holds (held) at REPEATABLE READ and SERIALIZABLE.
type sessionLock struct {
	key         int64
	keyed, held bool
}

func (l *sessionLock) sql() string {
	hi, lo := liveLock(l.key)
	return "SELECT pg_advisory_lock(" + strconv.Itoa(int(hi)) + ", " + strconv.Itoa(int(lo)) + ")"
}

// isolationData is the key of a connection's default_transaction_isolation in
// its pgconn.PgConn.CustomData.
const isolationData = "pgstore.default_transaction_isolation"

// snapshotIsolation reports whether c's transactions default to REPEATABLE
// READ or SERIALIZABLE, reading default_transaction_isolation on the first call
// for a connection.
func snapshotIsolation(ctx context.Context, c *pgx.Conn) (bool, error) {
	data := c.PgConn().CustomData()
	level, ok := data[isolationData].(string)
	if !ok {
		if err := c.QueryRow(ctx, "SHOW default_transaction_isolation").Scan(&level); err != nil {
			return false, err
		}
		data[isolationData] = level
	}
	return level == "repeatable read" || level == "serializable", nil
}

// txEnd ends the request's transaction: what claimTx and lockedTx share.
type txEnd struct {
	s    *Store
	conn *pgxpool.Conn // nil once the transaction ended and the connection went back
	htx  *handlerTx    // the handler's view of the transaction
	// ctx is the context the transaction was begun with (the handler's): once
	// it has ended, Commit rolls back, as database/sql does with a transaction
	// whose context ended, so that a handler past HandlerTimeout or its lost
	// lease commits nothing on any SQL store.
	ctx context.Context

	// lock is the key's advisory lock, which the session may hold
	// (claim-then-complete, see BeginTx); nil in the single transaction.
	lock *sessionLock

	// commitWith's batch.
	cbatch pgx.Batch
	cqq    [3]pgx.QueuedQuery
	cqp    [3]*pgx.QueuedQuery
}

// claimTx is the idem.Tx of the claim-then-complete flow.
type claimTx struct {
	txEnd
	// completion holds the arguments of the fenced UPDATE that Commit sends.
	completion []any
}

// Complete prepares the fenced completion; Commit sends it.
func (t *claimTx) Complete(_ context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	if err := checkIDs("complete", scope, key); err != nil {
		return err
	}
	args, err := completeArgs(scope, key, token, resp, expiresAt, t.s.fastArgs)
	if err != nil {
		return err
	}
	t.completion = args
	return nil
}

// Commit sends the prepared completion and COMMIT in one round trip.
func (t *claimTx) Commit(ctx context.Context) error {
	return t.commitWith(ctx, "complete", t.s.completeAndCommitSQL, t.completion, idem.ErrLockLost)
}

// Rollback aborts the transaction; a no-op after Commit.
func (t *claimTx) Rollback(ctx context.Context) error { return t.rollback(ctx) }

// commitWith commits the transaction. When args is nil it is a plain COMMIT.
// Otherwise it sends stmt (a statement that raises division_by_zero when its
// write matched no row) and COMMIT in one pipelined batch, and returns fenceErr,
// having committed nothing, when stmt raised.
//
// Whatever happens, the transaction is over when it returns: rolled back unless
// committed, the handler's Tx closed, and the connection back in the pool (closed
// by it when the rollback failed). It returns an error wrapping
// idem.ErrTxAborted, having committed nothing, when the transaction was already
// aborted (a statement of the handler failed) or rolled back by the handler.
func (t *txEnd) commitWith(ctx context.Context, op, stmt string, args []any, fenceErr error) error {
	c := t.conn
	if c == nil {
		return pgx.ErrTxClosed
	}
	how := t.htx.g.end() // no statement of the handler runs from here on
	defer t.release(ctx)
	pc := c.Conn().PgConn()
	switch {
	case how == endedRollback:
		return fmt.Errorf("pgstore: %s: the handler rolled back the transaction: %w", op, idem.ErrTxAborted)
	case pc.IsClosed():
		return fmt.Errorf("pgstore: %s: the connection of the transaction was closed before COMMIT, so nothing was committed (PostgreSQL rolls back the transaction of a lost connection); retry", op)
	case pc.TxStatus() == 'E' && t.htx.g.conflict.Load():
		return fmt.Errorf("pgstore: %s: a statement of the handler failed in a conflict with a concurrent transaction (a serialization failure or a deadlock) and PostgreSQL aborted the transaction: %w: %w", op, idem.ErrTxConflict, idem.ErrTxAborted)
	case pc.TxStatus() == 'E':
		return fmt.Errorf("pgstore: %s: a statement of the handler failed and PostgreSQL aborted the transaction: %w", op, idem.ErrTxAborted)
	case pc.TxStatus() == 'I':
		// The handler sent COMMIT (or ROLLBACK through Query, SendBatch or Conn)
		// itself: its writes may have committed. Do what a store without
		// transactions does: the fenced write alone, after the effects.
		if args == nil {
			return nil
		}
		_, err := c.Conn().Exec(ctx, stmt, args...)
		if isFenceError(err) {
			return fenceErr
		}
		if err != nil {
			return t.s.wrap(op+" (outside the transaction, which the handler ended itself)", err)
		}
		return nil
	}
	if err := t.ctx.Err(); err != nil {
		return fmt.Errorf("pgstore: %s: the transaction's context ended before COMMIT (%w), so it was rolled back and nothing was committed", op, context.Cause(t.ctx))
	}
	// The batch lives in t: no allocation for it or its queries.
	t.cqq[0] = pgx.QueuedQuery{SQL: stmt, Arguments: args}
	t.cqq[1] = pgx.QueuedQuery{SQL: "commit"}
	locked := t.lock != nil && t.lock.held
	if locked {
		hi, lo := liveLock(t.lock.key)
		t.cqq[2] = pgx.QueuedQuery{SQL: "select pg_advisory_unlock($1, $2)", Arguments: []any{hi, lo}}
	}
	t.cqp = [3]*pgx.QueuedQuery{&t.cqq[0], &t.cqq[1], &t.cqq[2]}
	t.cbatch = pgx.Batch{QueuedQueries: t.cqp[:]}
	if !locked {
		t.cbatch.QueuedQueries = t.cqp[:2]
	}
	if args == nil {
		t.cbatch.QueuedQueries = t.cbatch.QueuedQueries[1:]
	}
	br := c.Conn().SendBatch(ctx, &t.cbatch)
	var stmtErr error
	if args != nil {
		_, stmtErr = br.Exec()
	}
	var tag pgconn.CommandTag
	var commitErr error
	if stmtErr == nil {
		tag, commitErr = br.Exec()
	}
	if stmtErr == nil && commitErr == nil && locked {
		if _, err := br.Exec(); err == nil {
			t.lock.held = false // released with the COMMIT
		}
	}
	closeErr := br.Close()
	switch {
	case isFenceError(stmtErr):
		return fenceErr
	case isConflict(stmtErr), isConflict(commitErr),
		t.htx.g.conflict.Load() && (isInFailedTx(stmtErr) || errors.Is(commitErr, pgx.ErrTxCommitRollback) || tag.String() == "ROLLBACK"):
		return fmt.Errorf("pgstore: %s: PostgreSQL rolled the transaction back in a conflict with a concurrent one (%w): %w: %w", op, errors.Join(stmtErr, commitErr), idem.ErrTxConflict, idem.ErrTxAborted)
	case isInFailedTx(stmtErr), stmtErr == nil && commitErr == nil && closeErr == nil && tag.String() == "ROLLBACK",
		errors.Is(commitErr, pgx.ErrTxCommitRollback):
		return fmt.Errorf("pgstore: %s: PostgreSQL had aborted the transaction: %w", op, idem.ErrTxAborted)
	case isServerAnswer(stmtErr):
		// PostgreSQL refused the completion (or record insert): the transaction
		// aborted and the COMMIT queued behind it never ran.
		return fmt.Errorf("pgstore: %s: PostgreSQL refused the statement sent with COMMIT, so nothing was committed (%w): %w", op, stmtErr, idem.ErrTxAborted)
	case stmtErr == nil && isServerAnswer(commitErr):
		// PostgreSQL answered the COMMIT with an error (a deferred foreign key
		// or unique constraint): it rolled the transaction back.
		return fmt.Errorf("pgstore: commit: PostgreSQL refused the COMMIT and rolled the transaction back, so nothing was committed (%w): %w", commitErr, idem.ErrTxAborted)
	}
	err := stmtErr
	if err == nil {
		err = commitErr
	}
	if err == nil {
		err = closeErr
	}
	if err == nil {
		return nil
	}
	if idleTxTimeout(err) {
		// Raised only while the session idled in the transaction: before
		// PostgreSQL read anything of the batch.
		return fmt.Errorf("pgstore: %s: PostgreSQL ended the session before COMMIT, its transaction idle for longer than idle_in_transaction_session_timeout, so nothing was committed; keep the handler's transaction from idling that long (or raise the setting for this pool), and retry: %w", op, err)
	}
	if args != nil && deadsession.Is(stmtErr) {
		// Its session was over before it ran the statement sent ahead of
		// COMMIT: the COMMIT never ran.
		return fmt.Errorf("pgstore: %s: PostgreSQL had ended the transaction's session before COMMIT, so nothing was committed; retry: %w", op, err)
	}
	if pc.IsClosed() && !isServerAnswer(err) {
		return fmt.Errorf("pgstore: commit: the connection failed before PostgreSQL confirmed the COMMIT, so the transaction may or may not have committed: %w", err)
	}
	if stmtErr != nil {
		return t.s.wrap(op, stmtErr)
	}
	return fmt.Errorf("pgstore: commit: %w", err)
}

// rollback aborts the transaction and hands the connection back to the pool; a
// no-op once it ended.
func (t *txEnd) rollback(ctx context.Context) error {
	if t.conn == nil {
		return nil
	}
	t.htx.g.end()
	return t.release(ctx)
}

// release rolls back the transaction if it is still open, and hands the
// connection back to the pool, which closes it when it is not idle. A rollback
// that fails closes the connection, which rolls the transaction back as well.
func (t *txEnd) release(ctx context.Context) error {
	c := t.conn
	if c == nil {
		return nil
	}
	t.conn = nil
	if t.lock == nil || !t.lock.held {
		return endConn(ctx, c)
	}
	t.lock.held = false
	return endConnLocked(ctx, c, t.lock.key)
}

// endConnLocked is endConn for a connection whose session holds advisory lock
// lock: it rolls back, unlocks in the same round trip, and closes the
// connection — which frees the lock as well — when either fails, so that no
// pooled session keeps a key locked.
func endConnLocked(ctx context.Context, c *pgxpool.Conn, lock int64) error {
	defer c.Release()
	pc := c.Conn().PgConn()
	if pc.IsClosed() {
		return nil
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	hi, lo := liveLock(lock)
	sql := "SELECT pg_advisory_unlock(" + strconv.Itoa(int(hi)) + ", " + strconv.Itoa(int(lo)) + ")"
	if pc.TxStatus() != 'I' {
		sql = "ROLLBACK; " + sql
	}
	if _, err := c.Conn().Exec(rctx, sql); err != nil {
		_ = c.Conn().Close(rctx)
		return fmt.Errorf("pgstore: rollback and unlock: %w (the connection was closed, which rolls the transaction back and frees the lock)", err)
	}
	return nil
}

// endConn rolls back the transaction of c if one is open, and hands c back to
// the pool; a rollback that fails closes c, which rolls the transaction back as
// well.
func endConn(ctx context.Context, c *pgxpool.Conn) error {
	defer c.Release()
	pc := c.Conn().PgConn()
	if pc.IsClosed() || pc.TxStatus() == 'I' {
		return nil
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	if _, err := c.Conn().Exec(rctx, "rollback"); err != nil {
		_ = c.Conn().Close(rctx)
		return fmt.Errorf("pgstore: rollback: %w (the connection was closed, which rolls the transaction back)", err)
	}
	return nil
}

// rollbackTimeout bounds the ROLLBACK sent when a transaction ends without a
// commit; past it the connection is closed instead.
const rollbackTimeout = 5 * time.Second

// isInFailedTx reports whether err is in_failed_sql_transaction (25P02): the
// transaction had been aborted before the statement.
func isInFailedTx(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25P02"
}

// isConflict reports whether err is a serialization failure (40001) or a
// deadlock (40P01): PostgreSQL rolled the transaction back in a conflict with
// a concurrent one, and running it again may succeed.
func isConflict(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// isServerAnswer reports whether err is an error PostgreSQL answered (not a lost
// connection): the statement it answers did not commit.
func isServerAnswer(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && deadsession.Severity(pgErr) != "FATAL" && deadsession.Severity(pgErr) != "PANIC"
}

// idleTxTimeout reports whether err is PostgreSQL's FATAL error for a session
// that sat idle in its transaction past idle_in_transaction_session_timeout
// (25P03).
func idleTxTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25P03"
}

// isFenceError reports whether err is the error a statement sent with COMMIT
// raises when its write found the key held by another request: division_by_zero
// (22012) from completeAndCommitSQL or insertAndCommitSQL when their write
// matched no row, unique_violation (23505) from insertFreshSQL when a record
// appeared after BeginLocked's lookup.
func isFenceError(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "22012" || pgErr.Code == "23505")
}

// lockKey is the 64-bit advisory lock key of (scope, key) in this store's table.
func (s *Store) lockKey(scope, key string) int64 {
	var buf [256]byte // hashed on the stack unless scope and key are long
	b := buf[:0]
	b = binary.BigEndian.AppendUint64(b, uint64(len(s.lockNS)))
	b = append(b, s.lockNS...)
	b = binary.BigEndian.AppendUint64(b, uint64(len(scope)))
	b = append(b, scope...)
	b = binary.BigEndian.AppendUint64(b, uint64(len(key)))
	b = append(b, key...)
	sum := sha256.Sum256(b)
	return int64(binary.BigEndian.Uint64(sum[:]))
}

// BeginLocked implements idem.SingleTxStore. It sends BEGIN, the advisory lock
// and the record lookup in one pipelined round trip (pgx.Batch.BeginTx). The
// lookup runs after the lock was granted, with a snapshot of its own (READ
// COMMITTED), so it sees the record of any earlier holder of the lock, which
// committed before releasing it.
//
// A live record answers the request (replay, 409 or 422) whether or not the
// lock was granted: another reader of a complete key holds the lock only for
// its own lookup, and a complete record never changes until it expires, so
// concurrent retries of a completed key replay side by side instead of turning
// each other away with 409. Without the lock and without a live record, the key
// is in flight in another transaction: ErrInFlight.
//
// A replay thus costs two round trips: this batch, and the ROLLBACK the caller
// sends. Sending the lookup before BEGIN in the same batch would not spare the
// second: BEGIN runs whatever the lookup finds (only an error, which
// PostgreSQL logs, stops a pipeline). Rolling back in the background, so that
// the answer waits for one round trip, measured 60 % more backend CPU per
// replay (BenchmarkOrders/replay-single, c1 and c32) and no lower latency.
//
// Everything a request needs from here to its COMMIT (the transaction's state,
// the handler's Tx, the statements' parameters and scan targets) lives in the
// one lockedTx allocated here.
func (s *Store) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	if err := checkIDs("begin locked transaction", scope, key); err != nil {
		return ctx, nil, nil, err
	}
	t := &lockedTx{now: now}
	t.s = s
	t.rec = idem.Record{Scope: scope, Key: key}
	t.row.Record = &t.rec
	t.scopeA, t.keyA, t.nowA, t.lockA = byteaArg(scope), byteaArg(key), tsArg(now), int8Arg(s.lockKey(scope, key))
	if s.fastArgs {
		t.args[0], t.args[1], t.args[2], t.args[3] = &t.lockA, &t.scopeA, &t.keyA, &t.nowA
	} else {
		t.args[0], t.args[1], t.args[2], t.args[3] = int64(t.lockA), []byte(scope), []byte(key), now
	}
	var (
		conn *pgxpool.Conn
		br   pgx.BatchResults
		err  error
	)
	for tries := 0; ; tries++ {
		// Built afresh for every try: pgx keeps in the queued queries what it
		// prepared them as on the connection it sent them on.
		t.batch = pgx.Batch{QueuedQueries: t.qp[:0]}
		b := &t.batch
		b.BeginTx(pgx.TxOptions{})
		t.qq[0] = pgx.QueuedQuery{SQL: s.lockSQL, Arguments: t.args[0:4]}
		t.qq[1] = pgx.QueuedQuery{SQL: s.lookupSQL, Arguments: t.args[1:4]}
		b.QueuedQueries = append(b.QueuedQueries, &t.qq[0], &t.qq[1])
		if conn, err = s.pool.Acquire(ctx); err != nil {
			return ctx, nil, nil, s.wrap("begin locked transaction", err)
		}
		br = conn.Conn().SendBatch(ctx, b)
		_, err = br.Exec() // BEGIN
		if !s.retryDead(ctx, err, tries) {
			break
		}
		// The session had ended before it read the batch: try another one.
		_ = br.Close()
		conn.Release()
	}
	tx := br.Tx()
	locked, live := &t.locked, &t.live
	if err == nil {
		t.targets[0] = locked
		err = br.QueryRow().Scan(t.targets[:1]...)
	}
	found := false
	if err == nil {
		targets := t.row.appendTargets(append(t.targets[:0], live))
		err = br.QueryRow().Scan(targets...)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	*live = found && *live
	if err == nil && *live {
		err = t.row.finish()
	}
	switch {
	case err != nil:
		err = s.wrap("begin locked transaction", err)
	case !*locked && !*live:
		err = idem.ErrInFlight
	}
	t.conn, t.ctx = conn, ctx
	t.hx = handlerTx{g: &t.guard, tx: tx, root: true}
	t.htx = &t.hx
	if err != nil {
		_ = t.rollback(ctx)
		return ctx, nil, nil, err
	}
	var out *idem.Record
	if *live {
		out = &t.rec
	}
	t.fresh = !found
	return context.WithValue(ctx, txKey{}, pgx.Tx(t.htx)), t, out, nil
}

// lockedTx is the idem.LockedTx of the single-transaction flow.
type lockedTx struct {
	txEnd
	now          time.Time // the clock reading BeginLocked judged expiry by
	fresh        bool      // BeginLocked found no record, not even an expired one
	locked, live bool      // BeginLocked's lock and lookup results
	// stmt and insert are the record insert that Commit sends, and its arguments.
	stmt   string
	insert []any

	// BeginLocked's and Insert's storage, allocated with the lockedTx.
	hx                         handlerTx
	guard                      txGuard
	rec                        idem.Record
	row                        scanRecord
	batch                      pgx.Batch
	qq                         [2]pgx.QueuedQuery
	qp                         [3]*pgx.QueuedQuery
	args                       [14]any
	targets                    [12]any
	lockA                      int8Arg
	nowA                       tsArg
	scopeA, keyA, fpA          byteaArg
	tokenA                     textArg
	createdA, leaseA, expiresA tsArg
	statusA                    int4Arg
	bodyA, refA                bytesArg
}

// Insert prepares the insert of rec, which replaces a record that expired at the
// time of BeginLocked; Commit sends it together with COMMIT in one round trip,
// and returns idem.ErrInFlight, committing nothing, when a live record holds the
// key (a claim-then-complete request claimed it after the lookup). When
// BeginLocked found no record at all, the insert is a plain INSERT; otherwise
// an upsert that replaces the record only if it is still expired.
func (t *lockedTx) Insert(_ context.Context, rec *idem.Record) error {
	if err := checkIDs("insert record", rec.Scope, rec.Key); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("pgstore", "fingerprint", int64(len(rec.Fingerprint)), maxBytea); err != nil {
		return err
	}
	var (
		status  int32
		valid   bool
		hdr     []byte
		body    []byte
		omitted bool
		ref     []byte
		err     error
	)
	if r := rec.Response; r != nil {
		status, valid = int32(r.Status), true
		if hdr, err = encodeHeaders(r.Header); err != nil {
			return err
		}
		if err = checkResponse(r, hdr); err != nil {
			return err
		}
		body, omitted, ref = nullableBytes(r.Body, !r.BodyOmitted), r.BodyOmitted, refBytes(r.Ref)
	}
	a := &t.args
	if t.s.fastArgs {
		t.scopeA, t.keyA, t.fpA, t.tokenA = byteaArg(rec.Scope), byteaArg(rec.Key), byteaArg(rec.Fingerprint), textArg(rec.Token)
		t.createdA, t.leaseA, t.expiresA, t.nowA = tsArg(rec.CreatedAt), tsArg(rec.LeaseUntil), tsArg(rec.ExpiresAt), tsArg(t.now)
		t.statusA = int4Arg{v: status, valid: valid}
		t.bodyA, t.refA = body, ref
		*a = [14]any{&t.scopeA, &t.keyA, int16(rec.State), &t.fpA, &t.tokenA, &t.createdA, &t.leaseA, &t.expiresA,
			&t.statusA, hdr, &t.bodyA, omitted, &t.refA, &t.nowA}
	} else {
		*a = plainInsertArgs(rec, status, valid, hdr, body, omitted, ref, t.now)
	}
	t.stmt, t.insert = t.s.insertAndCommitSQL, a[:]
	switch {
	case t.fresh && rec.State == idem.StateComplete && !omitted && ref == nil && valid:
		// The usual record: state, body_omitted and ref as constants.
		a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9] = a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]
		t.stmt, t.insert = t.s.insertFreshPlainSQL, a[:10]
	case t.fresh:
		t.stmt, t.insert = t.s.insertFreshSQL, a[:13]
	}
	return nil
}

// plainInsertArgs are Insert's arguments as plain Go values, for connections
// that pick parameter types from them (Store.fastArgs false).
func plainInsertArgs(rec *idem.Record, status int32, valid bool, hdr, body []byte, omitted bool, ref []byte, now time.Time) [14]any {
	var st *int32
	if valid {
		st = &status
	}
	return [14]any{[]byte(rec.Scope), []byte(rec.Key), int16(rec.State), []byte(rec.Fingerprint), rec.Token,
		rec.CreatedAt, rec.LeaseUntil, rec.ExpiresAt, st, headersParam(hdr, false), body, omitted, ref, now}
}

// Commit sends the prepared insert and COMMIT in one round trip; the lock goes
// with the transaction.
func (t *lockedTx) Commit(ctx context.Context) error {
	return t.commitWith(ctx, "insert record", t.stmt, t.insert, idem.ErrInFlight)
}

// Rollback aborts the transaction and frees the lock; a no-op after Commit.
func (t *lockedTx) Rollback(ctx context.Context) error { return t.rollback(ctx) }
