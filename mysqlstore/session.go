package mysqlstore

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
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
	// maxPacket is the server's max_allowed_packet: a statement larger than that
	// is refused (error 1153), so a response that cannot fit is refused before
	// it is sent (see checkPacket).
	maxPacket int64
}

// settingsFor returns the store's settings, reading them on conn (the connection
// the caller's transaction will use: asking on another could wait forever for a
// pool held by transactions) on first use. It also decides the isolation level
// (see isolationFor).
func (s *Store) settingsFor(ctx context.Context, conn *sql.Conn) (*settings, error) {
	if st := s.settings.Load(); st != nil {
		return st, nil
	}
	const read = "SELECT @@log_bin, @@sql_log_bin, @@binlog_format, VERSION(), @@max_allowed_packet"
	var (
		logBin, sqlLogBin, maxPacket sql.NullInt64
		format, version              sql.NullString
	)
	st := &settings{multi: true}
	// A connection without multiStatements refuses two statements in one query
	// with a syntax error (1064) and runs neither. Any other failure (a driver
	// that does not pass over the first statement's empty result, say) also
	// means one statement per query.
	if err := conn.QueryRowContext(ctx, "DO 0; "+read).Scan(&logBin, &sqlLogBin, &format, &version, &maxPacket); err != nil {
		st.multi = false
	}
	var err error
	if !st.multi {
		err = conn.QueryRowContext(ctx, read).Scan(&logBin, &sqlLogBin, &format, &version, &maxPacket)
	}
	if err != nil {
		return nil, s.wrap(fmt.Errorf("reading the server's settings (log_bin, sql_log_bin, binlog_format, version, max_allowed_packet): %w", err))
	}
	if st.multi {
		var n sql.NullInt64
		st.foundRows = conn.QueryRowContext(ctx, "SELECT FOUND_ROWS()").Scan(&n) == nil
	}
	st.maxPacket = maxPacket.Int64
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

// packetOverhead is what a completion or an insert sends besides the response's
// headers, body and ref: the statement, the scope, key, token and fingerprint
// (each at most 512 bytes), the packet headers.
const packetOverhead = 8 << 10

// checkPacket refuses, with an *idem.FieldTooLargeError for its largest field
// (body, headers or ref), a response (its headers encoded as hdr) that cannot
// travel in one packet of the server's max_allowed_packet: the server would
// refuse the statement every time (error 1153), and a retry would only meet
// that again. Before the settings are read it refuses nothing (packetRefused
// explains the server's answer then).
func (s *Store) checkPacket(hdr, body []byte, ref string) error {
	st := s.settings.Load()
	if st == nil || st.maxPacket <= 0 {
		return nil
	}
	if int64(len(hdr))+int64(len(body))+int64(len(ref))+packetOverhead <= st.maxPacket {
		return nil
	}
	return packetError(st.maxPacket, hdr, body, ref)
}

// packetError is the *idem.FieldTooLargeError for the largest of the
// response's fields, whose limit is what the packet leaves it beside the
// others (0 when maxPacket is not known).
func packetError(maxPacket int64, hdr, body []byte, ref string) error {
	field, size, others := "body", int64(len(body)), int64(len(hdr))+int64(len(ref))
	if n := int64(len(hdr)); n > size {
		field, size, others = "headers", n, int64(len(body))+int64(len(ref))
	}
	if n := int64(len(ref)); n > size {
		field, size, others = "ref", n, int64(len(body))+int64(len(hdr))
	}
	limit := max(maxPacket-packetOverhead-others, 0)
	fte := &idem.FieldTooLargeError{Store: "mysqlstore", Field: field, Size: size, Limit: limit}
	if maxPacket <= 0 {
		return fmt.Errorf("%w (the server refused a statement larger than its max_allowed_packet)", fte)
	}
	return fmt.Errorf("%w (the stored response travels in one statement, and the server's max_allowed_packet is %d bytes)", fte, maxPacket)
}

// packetRefused returns an *idem.FieldTooLargeError (see packetError) when err
// is the server's refusal of a statement larger than max_allowed_packet (1153,
// ER_NET_PACKET_TOO_LARGE) or the driver's own (go-sql-driver's
// ErrPktTooLarge), nil otherwise. Nothing was written: the statement never ran.
func (s *Store) packetRefused(err error, hdr, body []byte, ref string) error {
	if err == nil {
		return nil
	}
	code, ok := errorNumber(err)
	if !(ok && code == 1153) && !strings.Contains(err.Error(), "packet for query is too large") {
		return nil
	}
	var maxPacket int64
	if st := s.settings.Load(); st != nil {
		maxPacket = st.maxPacket
	}
	return errors.Join(packetError(maxPacket, hdr, body, ref), err)
}
