package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Dialect names the SQL dialect of the business database.
type Dialect string

// The dialects the service speaks.
const (
	SQLite   Dialect = "sqlite"
	Postgres Dialect = "postgres"
	MySQL    Dialect = "mysql"
)

// Backend is the business database as the service sees it: where orders are
// written, and how a handler finds the transaction the idem store opened for the
// request. Make one with SQL or Pgx.
type Backend interface {
	// Dialect reports the SQL dialect.
	Dialect() Dialect
	// Transactional reports whether the handler writes in the idem store's
	// transaction (true), or in one of its own (false, for example when the keys live
	// in Redis).
	Transactional() bool

	inTx(ctx context.Context, fn func(q querier) error) error
	db() querier
	ping(ctx context.Context) error
}

// Tx is the transaction an order is inserted in, as Config.OnCreate gets it:
// SQL on SQLite and MySQL, Pgx on PostgreSQL; the other one is nil.
type Tx struct {
	SQL *sql.Tx
	Pgx pgx.Tx
}

// querier runs statements with '?' placeholders, rebound for the dialect.
type querier interface {
	// tx is the transaction the querier runs in (zero outside one).
	tx() Tx
	exec(ctx context.Context, query string, args ...any) error
	query(ctx context.Context, query string, args []any, row func(scan func(dest ...any) error) error) error
}

// SQL returns the Backend for a database/sql handle (SQLite or MySQL). txFunc
// returns the transaction the idem store opened for the request
// (sqlitestore.Tx, mysqlstore.Tx); nil, or a txFunc that returns nil, makes the
// handler open and commit its own transaction.
func SQL(db *sql.DB, dialect Dialect, txFunc func(context.Context) *sql.Tx) (Backend, error) {
	if db == nil {
		return nil, errors.New("orders: db is nil; pass the *sql.DB of the business database")
	}
	if dialect != SQLite && dialect != MySQL {
		return nil, fmt.Errorf("orders: dialect %q does not use database/sql here; use orders.SQLite or orders.MySQL, or orders.Pgx for PostgreSQL", dialect)
	}
	return &sqlBackend{sqlDB: db, dialect: dialect, txFunc: txFunc}, nil
}

// Pgx returns the Backend for a PostgreSQL pool. txFunc returns the transaction
// the idem store opened for the request (pgstore.Tx); nil, or a txFunc that returns
// nil, makes the handler open and commit its own transaction.
func Pgx(pool *pgxpool.Pool, txFunc func(context.Context) pgx.Tx) (Backend, error) {
	if pool == nil {
		return nil, errors.New("orders: pool is nil; pass the *pgxpool.Pool of the business database")
	}
	return &pgxBackend{pool: pool, txFunc: txFunc}, nil
}

type sqlBackend struct {
	sqlDB   *sql.DB
	dialect Dialect
	txFunc  func(context.Context) *sql.Tx
}

func (b *sqlBackend) Dialect() Dialect               { return b.dialect }
func (b *sqlBackend) Transactional() bool            { return b.txFunc != nil }
func (b *sqlBackend) db() querier                    { return sqlQ{b.sqlDB} }
func (b *sqlBackend) ping(ctx context.Context) error { return b.sqlDB.PingContext(ctx) }

func (b *sqlBackend) inTx(ctx context.Context, fn func(q querier) error) error {
	if b.txFunc != nil {
		if tx := b.txFunc(ctx); tx != nil {
			return fn(sqlQ{tx})
		}
	}
	tx, err := b.sqlDB.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(sqlQ{tx}); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

type sqlConn interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

type sqlQ struct{ c sqlConn }

func (q sqlQ) tx() Tx {
	t, _ := q.c.(*sql.Tx)
	return Tx{SQL: t}
}

func (q sqlQ) exec(ctx context.Context, query string, args ...any) error {
	_, err := q.c.ExecContext(ctx, query, args...)
	return err
}

func (q sqlQ) query(ctx context.Context, query string, args []any, row func(func(...any) error) error) error {
	rows, err := q.c.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := row(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

type pgxBackend struct {
	pool   *pgxpool.Pool
	txFunc func(context.Context) pgx.Tx
}

func (b *pgxBackend) Dialect() Dialect               { return Postgres }
func (b *pgxBackend) Transactional() bool            { return b.txFunc != nil }
func (b *pgxBackend) db() querier                    { return pgxQ{b.pool} }
func (b *pgxBackend) ping(ctx context.Context) error { return b.pool.Ping(ctx) }

func (b *pgxBackend) inTx(ctx context.Context, fn func(q querier) error) error {
	if b.txFunc != nil {
		if tx := b.txFunc(ctx); tx != nil {
			return fn(pgxQ{tx})
		}
	}
	return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error { return fn(pgxQ{tx}) })
}

// pgxConn is what a pool and a transaction have in common.
type pgxConn interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

type pgxQ struct{ c pgxConn }

func (q pgxQ) tx() Tx {
	t, _ := q.c.(pgx.Tx)
	return Tx{Pgx: t}
}

func (q pgxQ) exec(ctx context.Context, query string, args ...any) error {
	_, err := q.c.Exec(ctx, rebind(query), args...)
	return err
}

func (q pgxQ) query(ctx context.Context, query string, args []any, row func(func(...any) error) error) error {
	rows, err := q.c.Query(ctx, rebind(query), args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := row(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// rebind turns '?' placeholders into PostgreSQL's $1, $2, …. The service's
// queries contain no other question marks.
func rebind(q string) string {
	var b strings.Builder
	n := 0
	for _, r := range q {
		if r == '?' {
			n++
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}
