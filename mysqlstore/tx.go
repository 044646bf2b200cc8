package mysqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
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
//
// In the single-transaction flow (the default) the store runs the transaction
// on the connection itself, and Conn is the handle to use: Tx begins a *sql.Tx
// there on its first call, which costs two more round trips (database/sql's
// START TRANSACTION and the store's savepoint) and a third at the end
// (database/sql's own COMMIT). Tx returns nil when Conn was called first in the
// request (what the handler wrote through Conn would be committed by START
// TRANSACTION on its own), or when beginning the *sql.Tx failed.
func Tx(ctx context.Context) *sql.Tx {
	t, _ := ctx.Value(txKey{}).(*txn)
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.tx != nil || t.locked == nil || t.connUsed {
		return t.tx
	}
	tx, err := t.locked.beginSQLTx()
	if err != nil {
		return nil
	}
	t.tx = tx
	return tx
}

// Querier is what a handler runs its statements with: the methods *sql.Conn
// and *sql.Tx have in common.
type Querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	PrepareContext(ctx context.Context, query string) (*sql.Stmt, error)
}

// Conn returns the handle on the transaction the idem middleware opened for
// the request whose context is ctx, or nil outside one. It is the fastest way
// for a handler to write in the request's transaction, and the documented
// one:
//
//	q := mysqlstore.Conn(r.Context())
//	_, err := q.ExecContext(r.Context(), "INSERT INTO orders (item) VALUES (?)", item)
//
// In the single-transaction flow (the default) with multiStatements=true on
// the DSN, it runs the statements on the request's *sql.Conn, on which the
// store has begun the transaction itself (autocommit off, a savepoint), and
// refuses them once the transaction ended: no database/sql transaction, so a first-time request costs three round trips with one
// handler statement (add interpolateParams=true for that statement to be one).
// Otherwise it is the request's *sql.Tx, as Tx returns it.
//
// Never end the transaction (COMMIT, ROLLBACK, START TRANSACTION, a statement
// that commits implicitly such as DDL, or Close on the *sql.Conn): the
// middleware commits it with the stored response, or rolls it back.
func Conn(ctx context.Context) Querier {
	t, _ := ctx.Value(txKey{}).(*txn)
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.tx != nil || t.locked == nil {
		return t.tx
	}
	t.connUsed = true
	return t.locked.q
}

// errTxEnded is what the handler's connection answers once the middleware
// committed or rolled back the request's transaction.
var errTxEnded = fmt.Errorf("mysqlstore: the request's transaction has ended (the middleware committed it with the stored response, or rolled it back); a statement now would run outside it, so it is refused: %w", sql.ErrTxDone)

// connQuerier is the Querier Conn returns in the session's own transaction
// (the single-transaction flow with multiStatements): the request's *sql.Conn,
// which refuses every call once the transaction ended, as a *sql.Tx would. A
// statement sent after the commit or the rollback (by a goroutine the handler
// left running) would otherwise run in autocommit on the connection, before it
// goes back to the pool, and commit on its own. end waits for the calls in
// progress.
type connQuerier struct {
	mu     sync.RWMutex
	conn   *sql.Conn
	closed bool
}

// end blocks new calls and waits for those in progress; the function it
// returns marks the transaction ended and lets the calls go on, refused.
func (q *connQuerier) end() func() {
	if q == nil {
		return func() {}
	}
	q.mu.Lock()
	return func() {
		q.closed = true
		q.mu.Unlock()
	}
}

func (q *connQuerier) enter() bool {
	q.mu.RLock()
	if q.closed {
		q.mu.RUnlock()
		return false
	}
	return true
}

// ExecContext runs query on the request's connection, in its transaction.
func (q *connQuerier) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if !q.enter() {
		return nil, errTxEnded
	}
	defer q.mu.RUnlock()
	return q.conn.ExecContext(ctx, query, args...)
}

// QueryContext runs query on the request's connection, in its transaction.
func (q *connQuerier) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	if !q.enter() {
		return nil, errTxEnded
	}
	defer q.mu.RUnlock()
	return q.conn.QueryContext(ctx, query, args...)
}

// QueryRowContext runs query on the request's connection, in its transaction.
// Once the transaction ended, the connection is back in the pool (closed for
// this handle) and the row's Scan reports sql.ErrConnDone.
func (q *connQuerier) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	q.mu.RLock()
	defer q.mu.RUnlock()
	return q.conn.QueryRowContext(ctx, query, args...)
}

// PrepareContext prepares query on the request's connection.
func (q *connQuerier) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	if !q.enter() {
		return nil, errTxEnded
	}
	defer q.mu.RUnlock()
	return q.conn.PrepareContext(ctx, query)
}

// BeginTx implements idem.TxStore. It begins a READ COMMITTED transaction on a
// connection of its own and returns a context that carries it (see Tx). READ
// COMMITTED because the fencing does not need more: the completion is an UPDATE,
// a current read that sees the latest committed token under any isolation level;
// and it takes no gap locks on the handler's tables during ordinary reads and
// updates, so concurrent requests block and deadlock less than under InnoDB's
// default REPEATABLE READ. A handler that needs a consistent snapshot across
// several reads can lock what it reads (SELECT … FOR UPDATE or FOR SHARE).
//
// The transaction is guarded against the server ending it on its own. When
// InnoDB rolls it back — a deadlock victim (1213), a lock wait timeout under
// innodb_rollback_on_timeout — the session leaves it, and in autocommit mode
// every later statement would commit by itself: the handler's, if it ignores the
// error, and the completion. So the session runs with autocommit off while the
// transaction is open (a statement after the rollback opens a new transaction,
// which is never committed), and a savepoint set at the start marks the
// transaction: Complete and Commit release it, and when it is gone they report
// idem.ErrTxAborted and nothing commits. The session's autocommit is set back
// before the connection returns to the pool, or the connection is closed.
//
// Round trips: START TRANSACTION, then one SET (autocommit off, isolation level
// of the next transaction) and the savepoint; Complete releases the savepoint
// and updates; Commit commits and turns autocommit on. With multiStatements=true
// on the DSN the statements of each step go in one round trip (see the package
// doc, "Round trips").
//
// The transaction is bound to ctx: database/sql rolls it back when ctx ends,
// which happens when the middleware finds the lease lost (the middleware does not
// pass on the client's cancellation: a client that hangs up does not end it).
func (s *Store) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return ctx, nil, s.wrap(err)
	}
	st, err := s.settingsFor(ctx, conn)
	if err != nil {
		discard(conn)
		return ctx, nil, err
	}
	tx, _, err := s.beginOn(ctx, conn, st, "SET autocommit = 0, "+s.isolationSQL(st), "")
	if err != nil {
		discard(conn)
		return ctx, nil, err
	}
	t := &txn{s: s, st: st, conn: conn, tx: tx, ctx: ctx}
	return context.WithValue(ctx, txKey{}, t), t, nil
}

// The statements that guard a transaction (see BeginTx).
const (
	guardOff  = "SET autocommit = 1"
	mark      = "SAVEPOINT idem_tx"
	checkMark = "RELEASE SAVEPOINT idem_tx"
)

// statementLogged checks err for error 1665 (the statement-based binary log
// refuses InnoDB writes under READ COMMITTED; binlog_format was changed since the
// store looked): it switches the store's later transactions to REPEATABLE READ
// and returns an error that says so.
func (s *Store) statementLogged(err error) error {
	if code, ok := errorNumber(err); !ok || code != 1665 {
		return nil
	}
	s.isolation.Store(int32(sql.LevelRepeatableRead))
	return fmt.Errorf("mysqlstore: the server writes a statement-based binary log (binlog_format=STATEMENT), which refuses InnoDB writes under READ COMMITTED; nothing was committed, and the store's transactions use REPEATABLE READ from now on (or set binlog_format to ROW or MIXED): %w", err)
}

// beginOn begins a guarded transaction on conn: guard, a SET that turns
// autocommit off (and may fail on purpose with error 1231, changing nothing:
// see BeginLocked) and sets the isolation level of the next transaction, then
// the transaction and its savepoint, then read, a query in the transaction,
// when not empty (its rows are returned, to be closed by the caller).
//
// database/sql's BeginTx sends START TRANSACTION on its own, one round trip that
// cannot carry anything else. When the connections accept several statements,
// everything else follows in one more round trip: COMMIT (of the empty
// transaction START TRANSACTION began: the isolation level can only change
// between transactions), guard, SAVEPOINT and read; with autocommit off, the
// savepoint and the read begin the request's transaction, at the isolation level
// guard set. Otherwise guard comes first, before START TRANSACTION, and each
// statement is a round trip.
//
// On error the caller discards conn (whose session may be left with autocommit
// off), except after error 1231 from guard, when beginOn has ended the
// transaction and the session is as it was.
func (s *Store) beginOn(ctx context.Context, conn *sql.Conn, st *settings, guard, read string) (*sql.Tx, *sql.Rows, error) {
	if !st.multi {
		if _, err := conn.ExecContext(ctx, guard); err != nil {
			if setFailed(err) {
				return nil, nil, err
			}
			return nil, nil, s.wrap(fmt.Errorf("turning autocommit off for the transaction: %w", err))
		}
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return nil, nil, s.wrap(err)
	}
	stmts := []string{mark}
	if st.multi {
		stmts = []string{"COMMIT", guard, mark}
	}
	if read != "" {
		stmts = append(stmts, read)
	}
	rows, _, err := run(ctx, st, tx, read != "", stmts...)
	if err != nil {
		_ = tx.Rollback()
		if setFailed(err) {
			return nil, nil, err
		}
		return nil, nil, s.wrap(fmt.Errorf("beginning the transaction: %w", err))
	}
	return tx, rows, nil
}

// checkOpen reports, as an error wrapping idem.ErrTxAborted, that the server
// rolled back the transaction beginOn opened: its savepoint is gone (1305).
func (s *Store) checkOpen(ctx context.Context, tx *sql.Tx) error {
	_, err := tx.ExecContext(ctx, checkMark)
	if code, ok := errorNumber(err); ok && code == 1305 { // ER_SP_DOES_NOT_EXIST
		return errAborted(err)
	}
	if err != nil {
		return s.wrap(fmt.Errorf("checking that the transaction is still open: %w", err))
	}
	return nil
}

// unguard turns autocommit back on in conn's session and returns conn to the
// pool; when that cannot be confirmed it closes the connection instead. ended
// says that this store's own COMMIT or ROLLBACK ended the transaction; without
// it the connection is closed: turning autocommit on commits an open
// transaction, and when database/sql ends it on its own (the context ended:
// it marks the Tx done, then sends ROLLBACK and closes the connection), the SET
// could reach the server before that ROLLBACK and commit the handler's writes.
func unguard(ctx context.Context, conn *sql.Conn, ended bool) {
	if !ended {
		discard(conn)
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if _, err := conn.ExecContext(rctx, guardOff); err != nil {
		discard(conn)
		return
	}
	_ = conn.Close()
}

// discard closes conn's connection rather than returning it to the pool.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}

// deadlocked reports whether err, from a statement the store ran in a guarded
// transaction, is a deadlock (1213): InnoDB rolled the whole transaction back.
func deadlocked(err error) bool {
	code, ok := errorNumber(err)
	return ok && code == 1213
}

// errAborted wraps err, the error that showed the transaction ended, with
// idem.ErrTxAborted.
func errAborted(err error) error {
	return fmt.Errorf("mysqlstore: the server rolled back the handler's transaction (a deadlock or a lock wait timeout in it); nothing it wrote was committed, before or after: %w (%w)", idem.ErrTxAborted, err)
}

// txn is the idem.Tx of a Store.
type txn struct {
	s    *Store
	st   *settings
	conn *sql.Conn
	tx   *sql.Tx
	ctx  context.Context // the context the transaction is bound to

	// locked is the single-flow transaction this txn hands the handler, when
	// the store drives it on conn (beginLockedConn); tx is nil until Tx is
	// called then.
	locked *lockedTx

	mu       sync.Mutex
	checked  bool // the savepoint was released: the transaction was open then
	done     bool
	connUsed bool // Conn handed out conn: Tx may no longer begin a *sql.Tx
}

// Complete implements idem.Tx: the check that the transaction is still the one
// BeginTx opened, then the fenced UPDATE inside it. It returns an error wrapping
// idem.ErrTxAborted when the server had rolled the transaction back.
func (t *txn) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	args, err := t.s.completeArgs(scope, key, token, resp, expiresAt)
	if err != nil {
		return err
	}
	var res sql.Result
	small := len(args[1].([]byte))+len(args[2].([]byte)) <= inlineLimit
	if t.st.multi && small {
		// The check and the update in one round trip (see check for the order).
		t.mu.Lock()
		if t.checked {
			res, err = t.tx.ExecContext(ctx, completeSQL(t.s.q, args))
		} else {
			res, err = t.tx.ExecContext(ctx, checkMark+"; "+completeSQL(t.s.q, args))
			if code, ok := errorNumber(err); ok && code == 1305 { // ER_SP_DOES_NOT_EXIST
				t.mu.Unlock()
				return errAborted(err)
			}
			t.checked = err == nil
		}
		t.mu.Unlock()
	} else {
		// First the check, so that an aborted transaction's successor (which holds
		// the locks of the handler's statements after the abort) does not also lock
		// the record.
		if err := t.check(ctx); err != nil {
			return err
		}
		// Use the statement Claim prepared; never prepare one here, which would need a
		// second connection while this transaction holds one.
		if small {
			res, err = t.tx.ExecContext(ctx, completeSQL(t.s.q, args))
		} else if st := t.s.cached(t.s.q.complete); st != nil {
			res, err = t.tx.StmtContext(ctx, st).ExecContext(ctx, args...)
		} else {
			res, err = t.tx.ExecContext(ctx, t.s.q.complete, args...)
		}
	}
	if deadlocked(err) {
		return errAborted(err)
	}
	if serr := t.s.statementLogged(err); serr != nil {
		return serr
	}
	if perr := t.s.packetRefused(err, args[1].([]byte), args[2].([]byte), resp.Ref); perr != nil {
		return perr
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

// check releases the savepoint, once: an error wrapping idem.ErrTxAborted when
// the server rolled the transaction back.
func (t *txn) check(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.checkLocked(ctx)
}

func (t *txn) checkLocked(ctx context.Context) error {
	if t.checked {
		return nil
	}
	if err := t.s.checkOpen(ctx, t.tx); err != nil {
		if errors.Is(err, sql.ErrTxDone) && t.ctx.Err() != nil {
			return errors.Join(err, context.Cause(t.ctx))
		}
		return err
	}
	t.checked = true
	return nil
}

// Commit implements idem.Tx. Without a successful Complete before it, it first
// checks that the server has not rolled the transaction back (idem.ErrTxAborted,
// and nothing commits).
func (t *txn) Commit(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return t.explain(sql.ErrTxDone)
	}
	t.done = true
	if err := t.checkLocked(ctx); err != nil {
		unguard(t.ctx, t.conn, t.tx.Rollback() == nil)
		return err
	}
	err := t.tx.Commit()
	unguard(t.ctx, t.conn, err == nil)
	if serverError(err) {
		// The server answered the COMMIT with an error: nothing committed.
		return fmt.Errorf("mysqlstore: commit: the server refused the COMMIT, so nothing was committed (%w): %w", err, idem.ErrTxAborted)
	}
	return t.explain(err)
}

// Rollback implements idem.Tx. It is a no-op after Commit or an earlier Rollback.
func (t *txn) Rollback(context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil
	}
	t.done = true
	err := t.tx.Rollback()
	unguard(t.ctx, t.conn, err == nil)
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
