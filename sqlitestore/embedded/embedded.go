// Package embedded opens the embedded default database of idem: a SQLite file
// driven by the pure-Go modernc.org/sqlite driver (no cgo), set up for
// sqlitestore and for the application's own tables in the same file.
//
// It is the only package of idem that imports a SQLite driver; sqlitestore itself
// works with any database/sql SQLite driver the application registers.
package embedded

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"modernc.org/sqlite" // registers the "sqlite" driver
	sqlite3 "modernc.org/sqlite/lib"
)

// DriverName is the database/sql driver name registered by modernc.org/sqlite.
const DriverName = "sqlite"

// BusyTimeout is how long a statement waits for another connection's or
// process's write lock before it fails with SQLITE_BUSY.
const BusyTimeout = 10 * time.Second

// MaxOpenConns is the connection pool limit Open sets.
const MaxOpenConns = 8

// DSN returns the modernc.org/sqlite data source name Open uses for the database
// file at path, for programs that open the database themselves
// (sql.Open(embedded.DriverName, embedded.DSN(path))) with pool settings of
// their own. See Open for what each parameter does.
func DSN(path string) string {
	q := []string{
		"_pragma=busy_timeout(" + fmt.Sprint(BusyTimeout.Milliseconds()) + ")",
		"_pragma=journal_mode(WAL)",
		"_pragma=synchronous(NORMAL)",
		"_pragma=foreign_keys(1)",
		"_txlock=immediate",
	}
	return "file:" + escapePath(path) + "?" + strings.Join(q, "&")
}

// isBusy reports whether err is SQLITE_BUSY (of any extended kind).
func isBusy(err error) bool {
	var se *sqlite.Error
	return errors.As(err, &se) && se.Code()&0xff == sqlite3.SQLITE_BUSY
}

// escapePath escapes the characters that would end or change the path part of a
// SQLite URI filename.
func escapePath(p string) string {
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		switch c := p[i]; c {
		case '%', '?', '#':
			fmt.Fprintf(&b, "%%%02X", c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// Open opens (creating it if needed) the SQLite database file at path with the
// modernc.org/sqlite driver, and checks that it can be used. Every connection of
// the pool is set up with:
//
//   - journal_mode=WAL: readers never block the writer and the writer never
//     blocks readers, so replays and 409 answers are served while a handler holds
//     the write lock. WAL needs a file on a local file system (not NFS), and
//     creates path-wal and path-shm next to it.
//   - busy_timeout=10000 (BusyTimeout): a connection that finds the write lock
//     taken, by this process or another one, waits up to 10 s instead of failing at
//     once with SQLITE_BUSY ("database is locked").
//   - synchronous=NORMAL: with WAL, a commit is durable against a crash of the
//     process; a power loss may lose the last transactions but never corrupts the
//     file. Set PRAGMA synchronous=FULL yourself if you need more.
//   - foreign_keys=ON: SQLite leaves foreign keys unchecked unless asked, per
//     connection; the application's tables in the same file get them enforced.
//   - _txlock=immediate: every db.BeginTx issues BEGIN IMMEDIATE, taking the write
//     lock when the transaction starts (waiting up to the busy timeout). A deferred
//     transaction that reads first and writes later could fail with SQLITE_BUSY on
//     the upgrade, without waiting, when another connection wrote in between.
//     Read-only transactions (sql.TxOptions{ReadOnly: true}) stay deferred.
//
// SQLite allows one writer at a time per file; see the sqlitestore package
// documentation for what that means for idem. The pool is limited to
// MaxOpenConns (8) connections, all kept idle: enough for concurrent readers
// (WAL lets them run beside the writer), while more connections would only add
// writers polling for the one write lock (sqlitestore queues its own writes in
// process, in front of it) and page caches (one per connection). Connections are
// never closed for age, so the pragmas above are set once per connection.
//
// path must name a file; ":memory:" and the empty path are refused, because
// every pooled connection would get a database of its own. Close the *sql.DB
// when done.
func Open(path string) (*sql.DB, error) {
	if path == "" || path == ":memory:" || strings.HasPrefix(path, "file:") {
		return nil, fmt.Errorf("embedded: Open(%q): pass the path of a database file (for example \"idem.db\", or a file in t.TempDir() in tests); in-memory databases and URIs are not supported, because each pooled connection would see a database of its own", path)
	}
	db, err := sql.Open(DriverName, DSN(path))
	if err != nil {
		return nil, fmt.Errorf("embedded: open %s: %w", path, err)
	}
	db.SetMaxOpenConns(MaxOpenConns)
	db.SetMaxIdleConns(MaxOpenConns)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	// The first connection converts a new file to WAL, which needs an exclusive
	// lock that SQLite does not wait for: when several processes open a new file at
	// once, the losers get SQLITE_BUSY. Retry them until the busy timeout.
	var mode string
	deadline := time.Now().Add(BusyTimeout)
	for {
		err = db.QueryRow("PRAGMA journal_mode").Scan(&mode)
		if err == nil || !isBusy(err) || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("embedded: open %s: %w (check that the directory exists and is writable)", path, err)
	}
	if !strings.EqualFold(mode, "wal") {
		_ = db.Close()
		return nil, errors.New("embedded: open " + path + ": the database is in journal mode " + mode + ", not WAL; WAL needs a local file system that supports shared memory (not NFS or a read-only directory)")
	}
	return db, nil
}
