package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// errHandlerCommit is what a handler's own Commit of the request's transaction
// returns: the middleware commits it, together with the stored response.
var errHandlerCommit = errors.New("pgstore: the idem middleware commits this transaction together with the stored response; do not call Commit on pgstore.Tx, return from the handler instead (use tx.Begin for a savepoint you may commit or roll back)")

// txGuard is the state shared by the pgx.Tx the handler gets (handlerTx) and
// every savepoint it begins from it. Once the request's transaction is over
// (committed or rolled back by the middleware, rolled back by the handler, or
// ended by a COMMIT or ROLLBACK the handler sent as SQL), every method returns
// pgx.ErrTxClosed, so that no statement lands outside the transaction, in
// autocommit or on a connection the pool has handed to another request.
type txGuard struct {
	// mu is held for reading by each call into the transaction and for writing
	// by end, which therefore waits for calls in progress and admits no new one.
	mu     sync.RWMutex
	closed atomic.Bool
	// how records how the handler itself ended the transaction (an endedBy).
	how atomic.Uint32
	// lock is the key's advisory lock of a claim-then-complete transaction
	// (see Store.BeginTx); nil in the single transaction.
	lock *sessionLock
	// conflict records that a statement of the handler failed with a
	// serialization failure or a deadlock (SQLSTATE class 40), which aborted
	// the transaction: Commit then reports idem.ErrTxConflict.
	conflict atomic.Bool
	// ran records that the handler sent a statement (Exec, Query, QueryRow,
	// SendBatch, CopyFrom) in the transaction: a SET TRANSACTION after that is
	// PostgreSQL's to refuse (25001), never a reason to begin afresh, which
	// would roll back what the handler wrote.
	ran atomic.Bool
}

// note records a conflict error of the handler's statements, and returns err.
func (g *txGuard) note(err error) error {
	if isConflict(err) {
		g.conflict.Store(true)
	}
	return err
}

// endedBy says how the handler ended the request's transaction itself.
type endedBy uint8

const (
	endedNot      endedBy = iota // the transaction is the middleware's to end
	endedRollback                // the handler rolled back (Rollback, or ROLLBACK as SQL)
	endedCommit                  // the handler sent COMMIT as SQL: its writes committed
	endedUnknown                 // the handler ended it some other way (COMMIT or ROLLBACK through Query or SendBatch, tx.Conn())
)

// end closes the guard and reports how the handler ended the transaction.
func (g *txGuard) end() endedBy {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed.Store(true)
	return endedBy(g.how.Load())
}

// enter starts a call into the transaction; ok is false once it is over.
func (g *txGuard) enter() (ok bool) {
	g.mu.RLock()
	if g.closed.Load() {
		g.mu.RUnlock()
		return false
	}
	return true
}

func (g *txGuard) leave() { g.mu.RUnlock() }

// handlerTx is the pgx.Tx handed to handlers: the request's transaction (root)
// or a savepoint begun from it.
type handlerTx struct {
	g    *txGuard
	tx   pgx.Tx
	root bool
}

func newHandlerTx(tx pgx.Tx) *handlerTx { return &handlerTx{g: &txGuard{}, tx: tx, root: true} }

// noteEnd records that a statement the handler sent ended the transaction (a
// COMMIT or ROLLBACK as SQL), and closes the Tx: what the handler sends next
// would run outside any transaction. Called with g.mu held for reading.
func (t *handlerTx) noteEnd(tag pgconn.CommandTag) {
	if t.tx.Conn().PgConn().TxStatus() != 'I' {
		if tag.String() == "ROLLBACK" {
			// ROLLBACK AND CHAIN: the handler's writes are gone and a new
			// transaction began; committing it would store an answer whose
			// writes were rolled back.
			t.g.closed.Store(true)
			t.g.how.CompareAndSwap(uint32(endedNot), uint32(endedRollback))
		}
		return
	}
	t.g.closed.Store(true)
	how := endedUnknown
	switch tag.String() {
	case "COMMIT":
		how = endedCommit
	case "ROLLBACK":
		how = endedRollback
	}
	t.g.how.CompareAndSwap(uint32(endedNot), uint32(how))
}

// Begin starts a savepoint (a pseudo nested transaction).
func (t *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if !t.g.enter() {
		return nil, pgx.ErrTxClosed
	}
	defer t.g.leave()
	sp, err := t.tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &handlerTx{g: t.g, tx: sp}, nil
}

// Commit releases a savepoint. On the request's transaction itself it commits
// nothing and returns an error: the middleware commits it.
func (t *handlerTx) Commit(ctx context.Context) error {
	if !t.g.enter() {
		return pgx.ErrTxClosed
	}
	defer t.g.leave()
	if t.root {
		return errHandlerCommit
	}
	return t.tx.Commit(ctx)
}

// Rollback rolls back to a savepoint, or rolls back the request's transaction:
// none of the handler's writes commit, and the middleware learns that from
// Commit (idem.ErrTxAborted).
func (t *handlerTx) Rollback(ctx context.Context) error {
	if !t.root {
		if !t.g.enter() {
			return pgx.ErrTxClosed
		}
		defer t.g.leave()
		return t.tx.Rollback(ctx)
	}
	t.g.mu.Lock() // a state change: exclusive
	defer t.g.mu.Unlock()
	if t.g.closed.Load() {
		return pgx.ErrTxClosed
	}
	t.g.closed.Store(true)
	t.g.how.Store(uint32(endedRollback))
	return t.tx.Rollback(ctx) // on failure pgx closes the connection: rolled back all the same
}

// CopyFrom delegates to the transaction.
func (t *handlerTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if !t.g.enter() {
		return 0, pgx.ErrTxClosed
	}
	defer t.g.leave()
	t.g.ran.Store(true)
	n, err := t.tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
	return n, t.g.note(err)
}

// SendBatch delegates to the transaction.
func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if !t.g.enter() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	defer t.g.leave()
	t.g.ran.Store(true)
	return &guardBatch{BatchResults: t.tx.SendBatch(ctx, b), g: t.g}
}

// LargeObjects returns the transaction's large objects. They bypass the guard:
// do not use them after the handler returned.
func (t *handlerTx) LargeObjects() pgx.LargeObjects { return t.tx.LargeObjects() }

// Prepare delegates to the transaction.
func (t *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if !t.g.enter() {
		return nil, pgx.ErrTxClosed
	}
	defer t.g.leave()
	return t.tx.Prepare(ctx, name, sql)
}

// Exec delegates to the transaction. A COMMIT or ROLLBACK sent through it ends
// the transaction, and the Tx with it.
func (t *handlerTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if !t.g.enter() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	defer t.g.leave()
	first := !t.g.ran.Swap(true)
	if l := t.g.lock; first && t.root && l != nil && l.keyed && !l.held && len(arguments) == 0 && isSetTransaction(sql) {
		// The handler raises its transaction's isolation, before anything ran
		// in it (later, PostgreSQL refuses it). Before it does, the
		// session takes the key's lock (see Store.BeginTx) in a transaction of
		// its own — nothing has run in the handler's yet, which SET
		// TRANSACTION requires — and begins the handler's afresh.
		l.held = true // whatever fails below, the unlock at the end is harmless
		tag, err := t.tx.Conn().Exec(ctx, "ROLLBACK; "+l.sql()+"; COMMIT; BEGIN; "+sql)
		return tag, t.g.note(err)
	}
	tag, err := t.tx.Exec(ctx, sql, arguments...)
	t.noteEnd(tag)
	if err != nil && t.root && len(arguments) == 0 && isSetTransaction(sql) {
		err = explainSetTransaction(t.g.lock == nil, err)
	}
	return tag, t.g.note(err)
}

// explainSetTransaction says why PostgreSQL refused a handler's SET
// TRANSACTION (25001, it must come before any query), and what to do.
func explainSetTransaction(singleTx bool, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25001" {
		return err
	}
	if singleTx {
		return fmt.Errorf("pgstore: SET TRANSACTION cannot raise the isolation of the single-transaction flow's transaction (idem's lookup of the key is its first statement); serve this route with idem.Config{Flow: idem.FlowClaimComplete}, or make the level the session default (ALTER ROLE … SET default_transaction_isolation); the transaction is aborted: %w", err)
	}
	return fmt.Errorf("pgstore: SET TRANSACTION must be the handler's first statement in its transaction; the transaction is aborted: %w", err)
}

// beforeSetTransaction is Exec's handling of a SET TRANSACTION for Query and
// QueryRow: when sql is one, as the handler's first statement, in a
// claim-then-complete transaction, the session takes the key's lock in a
// transaction of its own and begins the handler's afresh, so that sql is the
// new transaction's first statement. It marks the transaction as used.
func (t *handlerTx) beforeSetTransaction(ctx context.Context, sql string, nargs int) error {
	first := !t.g.ran.Swap(true)
	l := t.g.lock
	if !first || !t.root || l == nil || !l.keyed || l.held || nargs != 0 || !isSetTransaction(sql) {
		return nil
	}
	l.held = true // whatever fails below, the unlock at the end is harmless
	_, err := t.tx.Conn().Exec(ctx, "ROLLBACK; "+l.sql()+"; COMMIT; BEGIN")
	return t.g.note(err)
}

// errRows is the pgx.Rows and pgx.Row of a query that was not sent.
type errRows struct{ err error }

func (errRows) Close()                                       {}
func (r errRows) Err() error                                 { return r.err }
func (errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                          { return r.err }
func (r errRows) Values() ([]any, error)                     { return nil, r.err }
func (errRows) RawValues() [][]byte                          { return nil }
func (errRows) Conn() *pgx.Conn                              { return nil }
func (errRows) TypeMap() *pgtype.Map                         { return pgtype.NewMap() }

// isSetTransaction reports whether sql is a SET TRANSACTION statement that
// raises the isolation to REPEATABLE READ or SERIALIZABLE.
func isSetTransaction(sql string) bool {
	l := strings.ToLower(skipComments(sql))
	f := strings.Fields(l)
	return len(f) >= 2 && f[0] == "set" && f[1] == "transaction" &&
		(strings.Contains(l, "serializable") || strings.Contains(l, "repeatable"))
}

// skipComments returns sql without its leading white space and comments
// ("-- …" to the end of the line, "/* … */", nested as PostgreSQL nests them).
func skipComments(sql string) string {
	for {
		sql = strings.TrimLeft(sql, " \t\r\n\f")
		switch {
		case strings.HasPrefix(sql, "--"):
			i := strings.IndexByte(sql, '\n')
			if i < 0 {
				return ""
			}
			sql = sql[i+1:]
		case strings.HasPrefix(sql, "/*"):
			depth, i := 1, 2
			for depth > 0 && i < len(sql) {
				switch {
				case strings.HasPrefix(sql[i:], "/*"):
					depth, i = depth+1, i+2
				case strings.HasPrefix(sql[i:], "*/"):
					depth, i = depth-1, i+2
				default:
					i++
				}
			}
			sql = sql[i:]
		default:
			return sql
		}
	}
}

// Query delegates to the transaction.
func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !t.g.enter() {
		return closedRows{}, pgx.ErrTxClosed
	}
	defer t.g.leave()
	if err := t.beforeSetTransaction(ctx, sql, len(args)); err != nil {
		return errRows{err}, err
	}
	rows, err := t.tx.Query(ctx, sql, args...)
	if err != nil {
		return rows, t.g.note(err)
	}
	return &guardRows{Rows: rows, g: t.g}, nil
}

// QueryRow delegates to the transaction.
func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !t.g.enter() {
		return closedRows{}
	}
	defer t.g.leave()
	if err := t.beforeSetTransaction(ctx, sql, len(args)); err != nil {
		return errRows{err}
	}
	rows, err := t.tx.Query(ctx, sql, args...)
	return guardRow{rows: rows, err: err, g: t.g}
}

// guardRows notes a conflict error the handler's query ends with.
type guardRows struct {
	pgx.Rows
	g *txGuard
}

// Next delegates, and notes the error the rows end with.
func (r *guardRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.g.note(r.Rows.Err())
	return false
}

// Err delegates, and notes the error.
func (r *guardRows) Err() error { return r.g.note(r.Rows.Err()) }

// guardRow is QueryRow's pgx.Row: pgx's own, on rows that note conflicts.
type guardRow struct {
	rows pgx.Rows
	err  error
	g    *txGuard
}

// Scan reads the first row as pgx's QueryRow does, and notes a conflict.
func (r guardRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.g.note(r.err)
	}
	rows := r.rows
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return r.g.note(err)
		}
		return pgx.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return r.g.note(err)
	}
	rows.Close()
	return r.g.note(rows.Err())
}

// guardBatch notes conflict errors of the handler's batch.
type guardBatch struct {
	pgx.BatchResults
	g *txGuard
}

// Exec delegates, and notes a conflict.
func (b *guardBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	return tag, b.g.note(err)
}

// Query delegates, on rows that note conflicts.
func (b *guardBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if err != nil {
		return rows, b.g.note(err)
	}
	return &guardRows{Rows: rows, g: b.g}, nil
}

// QueryRow delegates, on a row that notes a conflict.
func (b *guardBatch) QueryRow() pgx.Row {
	rows, err := b.BatchResults.Query()
	return guardRow{rows: rows, err: err, g: b.g}
}

// Close delegates, and notes a conflict.
func (b *guardBatch) Close() error { return b.g.note(b.BatchResults.Close()) }

// Conn returns the connection the transaction runs on. It bypasses the guard:
// statements sent through it after the handler returned run on a connection
// that is back in the pool.
func (t *handlerTx) Conn() *pgx.Conn { return t.tx.Conn() }

// closedRows is the pgx.Rows and pgx.Row of a query on an ended transaction.
type closedRows struct{}

func (closedRows) Close()                                       {}
func (closedRows) Err() error                                   { return pgx.ErrTxClosed }
func (closedRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (closedRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (closedRows) Next() bool                                   { return false }
func (closedRows) Scan(...any) error                            { return pgx.ErrTxClosed }
func (closedRows) Values() ([]any, error)                       { return nil, pgx.ErrTxClosed }
func (closedRows) RawValues() [][]byte                          { return nil }
func (closedRows) Conn() *pgx.Conn                              { return nil }
func (closedRows) TypeMap() *pgtype.Map                         { return pgtype.NewMap() }
