// Package deadsession tells whether PostgreSQL's answer to a round trip on a
// pooled connection says that the connection's session had ended before it
// read anything of that round trip, so that the round trip may be sent again
// on another connection. pgstore and pgoutbox share it.
package deadsession

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Severity returns e's severity in English: PostgreSQL 9.6 and later send it
// besides the one in lc_messages's language ("FATAL" is "SCHWERWIEGEND" on a
// German server).
func Severity(e *pgconn.PgError) string {
	if e.SeverityUnlocalized != "" {
		return e.SeverityUnlocalized
	}
	return e.Severity
}

// Is reports whether err, the answer to the first statement a round trip sent
// on a pooled connection, says that the connection's session had ended before
// anything of the round trip ran: PostgreSQL's FATAL error came first (the
// session ended while idle, by idle_session_timeout or pg_terminate_backend,
// and the server never read what followed). A broken connection (EOF, reset)
// does not count: the server may have run what it was sent; nor does a
// connection the server refused to open.
func Is(err error) bool {
	if err == nil {
		return false // before the errors.As targets, which escape: no allocation on success
	}
	var pgErr *pgconn.PgError
	var connErr *pgconn.ConnectError // a new connection refused ("shutting down"): no retry
	return errors.As(err, &pgErr) && Severity(pgErr) == "FATAL" && !errors.As(err, &connErr)
}

// Retry reports whether a round trip on pool whose first statement failed
// with first, after tries retries, is to be sent again: its session was dead
// (Is) and ctx is live. Every idle connection of the pool may have died at
// once (idle_session_timeout, a server restart), so it retries up to the
// pool's size: pgx closes each dead connection it meets, and the last try
// gets a new one.
func Retry(ctx context.Context, pool *pgxpool.Pool, first error, tries int) bool {
	return Is(first) && ctx.Err() == nil && tries <= int(pool.Config().MaxConns)
}
