package mysqlstore

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// settings is what the store learns about the server and the connections the
// *sql.DB makes, once, on first use (see Store.settingsFor).
type settings struct {
	// multi: the connections accept several statements in one query (the DSN has
	// go-sql-driver's multiStatements=true), so the store sends each group of its
	// statements in one round trip.
	multi bool
	// isoVar is the system variable that sets the next transaction's isolation
	// level: tx_isolation on MariaDB, transaction_isolation on MySQL.
	isoVar string
	// foundRows: the server has FOUND_ROWS() (deprecated on MySQL since 8.0.17),
	// with which BeginLocked sends its lock-free read and the lock in one round
	// trip (see BeginLocked).
	foundRows bool
}

// settingsFor returns the store's settings, reading them on conn (the connection
// the caller's transaction will use: asking on another could wait forever for a
// pool held by transactions) on first use. It also decides the isolation level
// (see isolationFor).
func (s *Store) settingsFor(ctx context.Context, conn *sql.Conn) (*settings, error) {
	if st := s.settings.Load(); st != nil {
		return st, nil
	}
	const read = "SELECT @@log_bin, @@sql_log_bin, @@binlog_format, VERSION()"
	var (
		logBin, sqlLogBin sql.NullInt64
		format, version   sql.NullString
	)
	st := &settings{multi: true}
	// A connection without multiStatements refuses two statements in one query
	// with a syntax error (1064) and runs neither. Any other failure (a driver
	// that does not pass over the first statement's empty result, say) also
	// means one statement per query.
	if err := conn.QueryRowContext(ctx, "DO 0; "+read).Scan(&logBin, &sqlLogBin, &format, &version); err != nil {
		st.multi = false
	}
	var err error
	if !st.multi {
		err = conn.QueryRowContext(ctx, read).Scan(&logBin, &sqlLogBin, &format, &version)
	}
	if err != nil {
		return nil, s.wrap(fmt.Errorf("reading the server's settings (log_bin, sql_log_bin, binlog_format, version): %w", err))
	}
	if st.multi {
		var n sql.NullInt64
		st.foundRows = conn.QueryRowContext(ctx, "SELECT FOUND_ROWS()").Scan(&n) == nil
	}
	st.isoVar = "transaction_isolation"
	if strings.Contains(strings.ToLower(version.String), "mariadb") {
		st.isoVar = "tx_isolation"
	}
	level := sql.LevelReadCommitted
	if logBin.Int64 == 1 && sqlLogBin.Int64 == 1 && strings.EqualFold(format.String, "STATEMENT") {
		level = sql.LevelRepeatableRead
	}
	s.isolation.CompareAndSwap(0, int32(level))
	s.settings.Store(st)
	return st, nil
}

// isolationSQL returns the assignment that sets the next transaction's isolation
// level (SET @@var without SESSION or GLOBAL applies to the next transaction only,
// so the pooled session keeps its own).
func (s *Store) isolationSQL(st *settings) string {
	level := "READ-COMMITTED"
	if sql.IsolationLevel(s.isolation.Load()) == sql.LevelRepeatableRead {
		level = "REPEATABLE-READ"
	}
	return "@@" + st.isoVar + " = '" + level + "'"
}

// execer is what *sql.Tx and *sql.Conn have in common.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// run sends stmts, which take no parameters, in one round trip when the
// connections accept several statements, else one after the other. The server
// stops at the first statement that fails, and so does run. When the last
// statement is a query, run returns its rows (the caller closes them); only the
// last statement may return rows.
func run(ctx context.Context, st *settings, q execer, query bool, stmts ...string) (*sql.Rows, sql.Result, error) {
	if st.multi && len(stmts) > 1 {
		all := strings.Join(stmts, "; ")
		if query {
			rows, err := q.QueryContext(ctx, all)
			return rows, nil, err
		}
		res, err := q.ExecContext(ctx, all)
		return nil, res, err
	}
	for i, stmt := range stmts {
		if i == len(stmts)-1 {
			if query {
				rows, err := q.QueryContext(ctx, stmt)
				return rows, nil, err
			}
			res, err := q.ExecContext(ctx, stmt)
			return nil, res, err
		}
		if _, err := q.ExecContext(ctx, stmt); err != nil {
			return nil, nil, err
		}
	}
	return nil, nil, nil
}

// lit returns b as an SQL literal: a hexadecimal string (X'…'), which means the
// same bytes whatever the connection's character set and sql_mode, or NULL for
// nil. Nothing but hex digits comes from the value, so it cannot change the
// statement.
func lit(b []byte) string {
	if b == nil {
		return "NULL"
	}
	out := make([]byte, 0, 3+2*len(b))
	out = append(out, "X'"...)
	out = hex.AppendEncode(out, b)
	return string(append(out, '\''))
}

// litString is lit for a string (never NULL).
func litString(s string) string {
	out := make([]byte, 0, 3+2*len(s))
	out = append(out, "X'"...)
	out = hex.AppendEncode(out, []byte(s))
	return string(append(out, '\''))
}

// appendLit appends v as lit does, or NULL when valid is false.
func appendLit[T string | []byte](b []byte, v T, valid bool) []byte {
	if !valid {
		return append(b, "NULL"...)
	}
	b = append(b, "X'"...)
	b = hex.AppendEncode(b, []byte(v))
	return append(b, '\'')
}

func litInt(n int64) string { return strconv.FormatInt(n, 10) }

// inlineLimit is the largest stored response (body and headers) that the store
// writes as SQL text, in hex, within a group of statements sent together; a
// larger one goes as a parameter of a prepared statement (binary, no
// expansion), in a round trip of its own, so the largest response that fits
// the server's max_allowed_packet stays what it is.
const inlineLimit = 64 << 10

// setFailed reports whether err is error 1231 (ER_WRONG_VALUE_FOR_VAR), which
// the store's guarded SET statements raise on purpose: SET autocommit =
// IF(cond, …, 2) fails, changing nothing, when cond does not hold.
func setFailed(err error) bool {
	code, ok := errorNumber(err)
	return ok && code == 1231
}

// serverError reports whether err came from the server (it carries an error
// number): the statement failed there, and the connection is in a known state.
func serverError(err error) bool {
	_, ok := errorNumber(err)
	return ok && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}
