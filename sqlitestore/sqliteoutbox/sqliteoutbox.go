// Package sqliteoutbox is the transactional outbox on SQLite: Enqueue writes a
// message into the outbox table in the caller's transaction (the handler's,
// sqlitestore.Tx), and the Outbox is the outbox.Source an outbox.Relay
// publishes from.
//
// SQLite has one writer at a time, so every lease is one atomic statement:
// several relays (in one process or several on the same file) never lease one
// message twice while a lease holds, and the order per partition holds. They
// do not publish faster than one: run one relay per file. Times are the
// process's clock (the relays and the handlers share the machine).
package sqliteoutbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore"
)

// DefaultTable is the outbox table when Config.Table is empty; dead letters go
// to the table of the same name with "_dead" appended.
const DefaultTable = "idem_outbox"

// Config configures an Outbox. A nil *Config means all defaults.
type Config struct {
	// Table is the outbox table: a letter or underscore followed by at most
	// 57 letters, digits or underscores. Defaults to DefaultTable.
	Table string
	// DeadLetterTable holds the dead-lettered messages with their reason.
	// Defaults to Table with "_dead" appended.
	DeadLetterTable string
	// MaxPayload is the largest payload Enqueue accepts
	// (outbox.DefaultMaxPayload by default).
	MaxPayload int
	// LockTimeout bounds the relay's wait for SQLite's write lock behind this
	// process's requests (sqlitestore.DefaultLockTimeout by default).
	LockTimeout time.Duration
}

// Outbox is an outbox table on SQLite. Safe for concurrent use.
type Outbox struct {
	db          *sql.DB
	table, dead string
	maxPayload  int
	lockTimeout time.Duration

	insertSQL, leaseSQL, markSQL, retrySQL, deadInsertSQL, deadDeleteSQL, deleteSQL string
}

var tableName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,57}$`)

// New returns the Outbox on cfg.Table of db (opened with
// sqlitestore/embedded.Open, like the Store's). It does not touch the
// database: call Migrate first.
func New(db *sql.DB, cfg *Config) (*Outbox, error) {
	if db == nil {
		return nil, errors.New("sqliteoutbox: db is nil; pass the *sql.DB of the Store, for example from embedded.Open(\"idem.db\")")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.DeadLetterTable == "" {
		c.DeadLetterTable = c.Table + "_dead"
	}
	for _, t := range []string{c.Table, c.DeadLetterTable} {
		if !tableName.MatchString(t) {
			return nil, fmt.Errorf("sqliteoutbox: table %q is not a plain identifier of at most 58 letters, digits or underscores", t)
		}
	}
	if c.MaxPayload <= 0 {
		c.MaxPayload = outbox.DefaultMaxPayload
	}
	if c.LockTimeout <= 0 {
		c.LockTimeout = sqlitestore.DefaultLockTimeout
	}
	t, d := `"`+c.Table+`"`, `"`+c.DeadLetterTable+`"`
	o := &Outbox{db: db, table: t, dead: d, maxPayload: c.MaxPayload, lockTimeout: c.LockTimeout}
	cols := "seq, id, subject, payload, headers, partition_key, enqueued_at, attempts"
	o.insertSQL = "INSERT INTO " + t + " (id, subject, payload, headers, partition_key, enqueued_at) VALUES (?, ?, ?, ?, ?, ?)"
	o.leaseSQL = `UPDATE ` + t + ` SET lease_owner = ?1, lease_until = ?2 + ?3, attempts = attempts + 1
WHERE seq IN (
  SELECT o.seq FROM ` + t + ` o
  WHERE o.published_at IS NULL AND o.next_attempt_at <= ?2
    AND (o.lease_until IS NULL OR o.lease_until <= ?2)
    AND NOT EXISTS (SELECT 1 FROM ` + t + ` p WHERE p.partition_key = o.partition_key AND p.published_at IS NULL AND p.seq < o.seq)
  ORDER BY o.seq LIMIT ?4)
RETURNING seq, id, subject, payload, headers, partition_key, enqueued_at, attempts - 1`
	o.markSQL = "UPDATE " + t + " SET published_at = ?, lease_owner = NULL, lease_until = NULL WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.retrySQL = "UPDATE " + t + " SET lease_owner = NULL, lease_until = NULL, next_attempt_at = ?, last_error = ? WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deadInsertSQL = "INSERT INTO " + d + " (" + cols + ", reason, dead_at) SELECT " + cols + ", ?, ? FROM " + t + " WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deadDeleteSQL = "DELETE FROM " + t + " WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deleteSQL = "DELETE FROM " + t + " WHERE seq IN (SELECT seq FROM " + t + " WHERE published_at IS NOT NULL AND published_at < ? ORDER BY published_at LIMIT ?)"
	return o, nil
}

// Table returns the outbox table's name, quoted.
func (o *Outbox) Table() string { return o.table }

// Migrate creates the outbox and dead-letter tables and their indexes if they
// do not exist.
func (o *Outbox) Migrate(ctx context.Context) error {
	name := strings.Trim(o.table, `"`)
	ddl := []string{
		`CREATE TABLE IF NOT EXISTS ` + o.table + ` (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL,
  subject TEXT NOT NULL,
  payload BLOB NOT NULL,
  headers TEXT,
  partition_key TEXT NOT NULL,
  enqueued_at INTEGER NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL DEFAULT 0,
  lease_owner TEXT,
  lease_until INTEGER,
  last_error TEXT,
  published_at INTEGER)`,
		`CREATE INDEX IF NOT EXISTS "` + name + `_pending_idx" ON ` + o.table + ` (partition_key, seq) WHERE published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS "` + name + `_ready_idx" ON ` + o.table + ` (seq) WHERE published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS "` + name + `_published_idx" ON ` + o.table + ` (published_at) WHERE published_at IS NOT NULL`,
		`CREATE TABLE IF NOT EXISTS ` + o.dead + ` (
  seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL,
  subject TEXT NOT NULL,
  payload BLOB NOT NULL,
  headers TEXT,
  partition_key TEXT NOT NULL,
  enqueued_at INTEGER NOT NULL,
  attempts INTEGER NOT NULL,
  reason TEXT NOT NULL,
  dead_at INTEGER NOT NULL)`,
	}
	unlock, err := sqlitestore.LockWrites(ctx, o.db, o.lockTimeout)
	if err != nil {
		return fmt.Errorf("sqliteoutbox: migrate: %w", err)
	}
	defer unlock()
	for _, s := range ddl {
		if _, err := o.db.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("sqliteoutbox: migrate %s: %w", o.table, err)
		}
	}
	return nil
}

func nanos(t time.Time) int64 { return t.UnixNano() }

// Enqueue writes m into the outbox in tx; a nil tx means the transaction of
// the request idem is executing under ctx (sqlitestore.Tx(ctx)). It fills in
// m's defaults and checks it (outbox.Prepare).
func (o *Outbox) Enqueue(ctx context.Context, tx *sql.Tx, m outbox.Message) error {
	if tx == nil {
		tx = sqlitestore.Tx(ctx)
		if tx == nil {
			return outbox.ErrNoTx
		}
	}
	m, err := outbox.Prepare(ctx, m, o.maxPayload)
	if err != nil {
		return err
	}
	var headers sql.NullString
	if len(m.Headers) > 0 {
		b, err := json.Marshal(m.Headers)
		if err != nil {
			return fmt.Errorf("sqliteoutbox: encode headers: %w", err)
		}
		headers = sql.NullString{String: string(b), Valid: true}
	}
	if _, err := tx.ExecContext(ctx, o.insertSQL, m.ID, m.Subject, m.Payload, headers, m.PartitionKey, nanos(time.Now())); err != nil {
		return fmt.Errorf("sqliteoutbox: enqueue into %s: %w", o.table, err)
	}
	return nil
}

// write runs f under the process's SQLite write gate.
func (o *Outbox) write(ctx context.Context, f func() error) error {
	unlock, err := sqlitestore.LockWrites(ctx, o.db, o.lockTimeout)
	if err != nil {
		return err
	}
	defer unlock()
	return f()
}

// Lease implements outbox.Source.
func (o *Outbox) Lease(ctx context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	var out []outbox.Stored
	err := o.write(ctx, func() error {
		rows, err := o.db.QueryContext(ctx, o.leaseSQL, owner, nanos(time.Now()), int64(d), n)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var s outbox.Stored
			var headers sql.NullString
			var enq int64
			if err := rows.Scan(&s.Seq, &s.ID, &s.Subject, &s.Payload, &headers, &s.PartitionKey, &enq, &s.Attempts); err != nil {
				return err
			}
			s.EnqueuedAt = time.Unix(0, enq)
			if headers.Valid {
				if err := json.Unmarshal([]byte(headers.String), &s.Headers); err != nil {
					return fmt.Errorf("headers of message %d: %w", s.Seq, err)
				}
			}
			out = append(out, s)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("sqliteoutbox: lease: %w", err)
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j].Seq < out[j-1].Seq; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out, nil
}

// MarkPublished implements outbox.Source.
func (o *Outbox) MarkPublished(ctx context.Context, owner string, seqs ...int64) (int, error) {
	if len(seqs) == 0 {
		return 0, nil
	}
	n := 0
	err := o.write(ctx, func() error {
		tx, err := o.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		now := nanos(time.Now())
		for _, s := range seqs {
			res, err := tx.ExecContext(ctx, o.markSQL, now, s, owner)
			if err != nil {
				return err
			}
			k, _ := res.RowsAffected()
			n += int(k)
		}
		return tx.Commit()
	})
	if err != nil {
		return 0, fmt.Errorf("sqliteoutbox: mark published: %w", err)
	}
	return n, nil
}

// Retry implements outbox.Source.
func (o *Outbox) Retry(ctx context.Context, owner string, seq int64, retryIn time.Duration, reason string) error {
	err := o.write(ctx, func() error {
		_, err := o.db.ExecContext(ctx, o.retrySQL, nanos(time.Now().Add(retryIn)), clean(reason), seq, owner)
		return err
	})
	if err != nil {
		return fmt.Errorf("sqliteoutbox: retry: %w", err)
	}
	return nil
}

// DeadLetter implements outbox.Source.
func (o *Outbox) DeadLetter(ctx context.Context, owner string, seq int64, reason string) error {
	err := o.write(ctx, func() error {
		tx, err := o.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, o.deadInsertSQL, clean(reason), nanos(time.Now()), seq, owner); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, o.deadDeleteSQL, seq, owner); err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return fmt.Errorf("sqliteoutbox: dead-letter: %w", err)
	}
	return nil
}

// DeletePublished implements outbox.Source.
func (o *Outbox) DeletePublished(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	var n int64
	err := o.write(ctx, func() error {
		res, err := o.db.ExecContext(ctx, o.deleteSQL, nanos(time.Now().Add(-olderThan)), limit)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("sqliteoutbox: delete published: %w", err)
	}
	return int(n), nil
}

// Stats implements outbox.Source.
func (o *Outbox) Stats(ctx context.Context) (outbox.Stats, error) {
	var s outbox.Stats
	var oldest sql.NullInt64
	err := o.db.QueryRowContext(ctx, "SELECT (SELECT count(*) FROM "+o.table+" WHERE published_at IS NULL), (SELECT min(enqueued_at) FROM "+o.table+" WHERE published_at IS NULL), (SELECT count(*) FROM "+o.dead+")").Scan(&s.Pending, &oldest, &s.DeadLetters)
	if err != nil {
		return s, fmt.Errorf("sqliteoutbox: stats: %w", err)
	}
	if oldest.Valid {
		s.OldestPending = max(0, time.Since(time.Unix(0, oldest.Int64)))
	}
	return s, nil
}

// DeadLetter is a dead-lettered message as DeadLetters reads it
// (outbox.DeadLetter, the same for every store).
type DeadLetter = outbox.DeadLetter

// DeadLetters returns up to limit dead-lettered messages, oldest first.
func (o *Outbox) DeadLetters(ctx context.Context, limit int) ([]DeadLetter, error) {
	rows, err := o.db.QueryContext(ctx, "SELECT seq, id, subject, payload, headers, partition_key, enqueued_at, attempts, reason, dead_at FROM "+o.dead+" ORDER BY seq LIMIT ?", limit)
	if err != nil {
		return nil, fmt.Errorf("sqliteoutbox: dead letters: %w", err)
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var d DeadLetter
		var headers sql.NullString
		var enq, dead int64
		if err := rows.Scan(&d.Seq, &d.ID, &d.Subject, &d.Payload, &headers, &d.PartitionKey, &enq, &d.Attempts, &d.Reason, &dead); err != nil {
			return nil, fmt.Errorf("sqliteoutbox: dead letters: %w", err)
		}
		d.EnqueuedAt, d.DeadAt = time.Unix(0, enq), time.Unix(0, dead)
		if headers.Valid {
			_ = json.Unmarshal([]byte(headers.String), &d.Headers)
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// Redrive moves dead-lettered messages back into the outbox, after whatever
// made them unpublishable was repaired: each gets a new sequence number, at
// the end of its partition, keeps its ID, and is published like a new
// message. It returns how many it moved.
func (o *Outbox) Redrive(ctx context.Context, seqs ...int64) (int, error) {
	n := 0
	err := o.write(ctx, func() error {
		tx, err := o.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		for _, seq := range seqs {
			res, err := tx.ExecContext(ctx, "INSERT INTO "+o.table+" (id, subject, payload, headers, partition_key, enqueued_at) SELECT id, subject, payload, headers, partition_key, enqueued_at FROM "+o.dead+" WHERE seq = ?", seq)
			if err != nil {
				return err
			}
			k, _ := res.RowsAffected()
			n += int(k)
			if _, err := tx.ExecContext(ctx, "DELETE FROM "+o.dead+" WHERE seq = ?", seq); err != nil {
				return err
			}
		}
		return tx.Commit()
	})
	if err != nil {
		return 0, fmt.Errorf("sqliteoutbox: redrive: %w", err)
	}
	return n, nil
}

func clean(reason string) string {
	reason = strings.ToValidUTF8(strings.ReplaceAll(reason, "\x00", ""), "?")
	if len(reason) > 4096 {
		reason = strings.ToValidUTF8(reason[:4096], "")
	}
	return reason
}

var _ outbox.Source = (*Outbox)(nil)
