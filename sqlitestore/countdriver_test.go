package sqlitestore_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/sqlitestore/embedded"
)

// stmtCounts counts what a database/sql pool sends to the SQLite driver.
type stmtCounts struct {
	stmts    atomic.Int64 // statements executed, BEGIN, COMMIT and ROLLBACK included
	begins   atomic.Int64 // transactions begun
	prepares atomic.Int64 // statements prepared for later use (not one-shot ones)
	writes   atomic.Int64 // statements that are not a SELECT, BEGIN, COMMIT or ROLLBACK
}

type countSnapshot struct{ stmts, begins, prepares, writes int64 }

func (c *stmtCounts) snapshot() countSnapshot {
	return countSnapshot{c.stmts.Load(), c.begins.Load(), c.prepares.Load(), c.writes.Load()}
}

func (a countSnapshot) sub(b countSnapshot) countSnapshot {
	return countSnapshot{a.stmts - b.stmts, a.begins - b.begins, a.prepares - b.prepares, a.writes - b.writes}
}

func (c *stmtCounts) statement(query string) {
	c.stmts.Add(1)
	// Not strings.ToUpper of the whole query: the benchmarks would count its
	// copy of every statement as the store's cost.
	q := strings.TrimLeft(query, " \t\r\n")
	if len(q) < 6 || !strings.EqualFold(q[:6], "SELECT") {
		c.writes.Add(1)
	}
}

// openCountingDB is openDB through a driver wrapper that counts statements: the
// same driver, DSN and pool settings as embedded.Open.
func openCountingDB(t testing.TB) (*sql.DB, *stmtCounts) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idem.db")
	plain, err := embedded.Open(path) // creates the file in WAL mode
	if err != nil {
		t.Fatal(err)
	}
	drv := plain.Driver()
	_ = plain.Close()
	n := &stmtCounts{}
	db := sql.OpenDB(&countConnector{dsn: embedded.DSN(path), drv: drv, n: n})
	db.SetMaxOpenConns(embedded.MaxOpenConns)
	db.SetMaxIdleConns(embedded.MaxOpenConns)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	t.Cleanup(func() { _ = db.Close() })
	return db, n
}

type countConnector struct {
	dsn string
	drv driver.Driver
	n   *stmtCounts
}

func (c *countConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	if walPages {
		// No automatic checkpoint: the WAL keeps every frame written, and
		// benchOrder counts them.
		_, err := conn.(driver.ExecerContext).ExecContext(context.Background(), "PRAGMA wal_autocheckpoint = 0", nil)
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
	}
	return &countConn{conn: conn, n: c.n}, nil
}

func (c *countConnector) Driver() driver.Driver { return c.drv }

// countConn wraps the driver's connection; the driver implements every
// interface used here.
type countConn struct {
	conn driver.Conn
	n    *stmtCounts
}

func (c *countConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *countConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	s, err := c.conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	c.n.prepares.Add(1)
	return &countStmt{stmt: s, query: query, n: c.n}, nil
}

func (c *countConn) Close() error { return c.conn.Close() }

func (c *countConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *countConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.n.stmts.Add(1)
	tx, err := c.conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	c.n.begins.Add(1)
	return &countTx{tx: tx, n: c.n}, nil
}

func (c *countConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	c.n.statement(query)
	return c.conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (c *countConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	c.n.statement(query)
	return c.conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (c *countConn) ResetSession(ctx context.Context) error {
	return c.conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *countConn) IsValid() bool { return c.conn.(driver.Validator).IsValid() }

type countStmt struct {
	stmt  driver.Stmt
	query string
	n     *stmtCounts
}

func (s *countStmt) Close() error  { return s.stmt.Close() }
func (s *countStmt) NumInput() int { return s.stmt.NumInput() }

func (s *countStmt) Exec([]driver.Value) (driver.Result, error) {
	panic("countStmt.Exec: database/sql calls ExecContext")
}

func (s *countStmt) Query([]driver.Value) (driver.Rows, error) {
	panic("countStmt.Query: database/sql calls QueryContext")
}

func (s *countStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.n.statement(s.query)
	return s.stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *countStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.n.statement(s.query)
	return s.stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}

type countTx struct {
	tx driver.Tx
	n  *stmtCounts
}

func (t *countTx) Commit() error   { t.n.stmts.Add(1); return t.tx.Commit() }
func (t *countTx) Rollback() error { t.n.stmts.Add(1); return t.tx.Rollback() }
