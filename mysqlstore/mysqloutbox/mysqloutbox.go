// Package mysqloutbox is the transactional outbox on MySQL 8 and MariaDB
// 10.6+: Enqueue writes a message into the outbox table in the caller's
// transaction (the handler's, mysqlstore.Tx), and the Outbox is the
// outbox.Source an outbox.Relay publishes from. Several relays may share one
// table: the heads of the partitions are locked with FOR UPDATE SKIP LOCKED at
// READ COMMITTED, each with, behind it, up to 63 of the messages that follow
// it in its partition (a run, which the relay publishes in order), so the
// order per partition holds. Lease finds the heads by walking the partitions
// in partition-key order from where its previous call stopped (round robin,
// bounded; the index head_idx, which Migrate adds to a table an earlier
// release created): a lease costs the partitions it walks, not the messages
// queued behind their heads.
//
// Times are the database's (NOW(6)); the columns are TIMESTAMP(6), stored
// as instants, so sessions in different fixed-offset time zones (+13:00 and
// -11:00, say) agree on every lease, retry time and age
// (TestSessionTimeZones). A session time zone with daylight saving time
// ('Europe/Berlin') is not safe in the hour after its clocks go back: NOW(6)
// is then an ambiguous wall-clock time, and a lease written or judged in it
// can be an hour off (lapsed at once, or held an hour too long). Give the
// relay's and the handlers' connections a fixed offset (time_zone='+00:00'
// in the DSN) if the server's default zone has DST. The DSN needs no
// parseTime.
package mysqloutbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/outbox"
)

// DefaultTable is the outbox table when Config.Table is empty; dead letters go
// to Table + "_dead". (Earlier releases also created Table + "_locks", for
// partition locks that Enqueue no longer takes: it may be dropped.)
const DefaultTable = "idem_outbox"

// maxRun is the most messages Lease takes behind a head in its partition.
const maxRun = 63

// Config configures an Outbox. A nil *Config means all defaults.
type Config struct {
	// Table is the outbox table: letters, digits and underscores, at most 58
	// bytes, optionally qualified by a database ("shop.idem_outbox").
	// Defaults to DefaultTable.
	Table string
	// DeadLetterTable holds the dead-lettered messages with their reason.
	// Defaults to Table with "_dead" appended.
	DeadLetterTable string
	// MaxPayload is the largest payload Enqueue accepts
	// (outbox.DefaultMaxPayload by default); keep it under the server's
	// max_allowed_packet.
	MaxPayload int
}

// Outbox is an outbox table on MySQL or MariaDB. Safe for concurrent use.
type Outbox struct {
	db          *sql.DB
	table, dead string
	maxPayload  int
	// walkSQL[inclusive][bounded]: a page of the walk from after (or at)
	// a key, to the end of the keys or up to (and with) a key.
	walkSQL [2][2]string

	mu     sync.Mutex
	cursor string // the partition key the last lease's walk got to

	insertSQL, lockHeadsSQL, runSQL, leaseSQL, readSQL, markSQL, retrySQL, deadLockSQL, deadInsertSQL, deadDeleteSQL, deleteSQL, statsSQL string
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,57}$`)

func quote(name string) (string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("mysqloutbox: table %q: use name or database.name", name)
	}
	for i, p := range parts {
		if !identRE.MatchString(p) {
			return "", fmt.Errorf("mysqloutbox: table %q: each part must be letters, digits and underscores, at most 58 bytes", name)
		}
		parts[i] = "`" + p + "`"
	}
	return strings.Join(parts, "."), nil
}

// New returns the Outbox on cfg.Table of db. It does not touch the database:
// call Migrate first.
func New(db *sql.DB, cfg *Config) (*Outbox, error) {
	if db == nil {
		return nil, errors.New("mysqloutbox: db is nil; pass the *sql.DB of the Store")
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
	if c.MaxPayload <= 0 {
		c.MaxPayload = outbox.DefaultMaxPayload
	}
	t, err := quote(c.Table)
	if err != nil {
		return nil, err
	}
	d, err := quote(c.DeadLetterTable)
	if err != nil {
		return nil, err
	}
	o := &Outbox{db: db, table: t, dead: d, maxPayload: c.MaxPayload}
	cols := "seq, id, subject, payload, headers, partition_key, enqueued_at, attempts"
	o.insertSQL = "INSERT INTO " + t + " (id, subject, payload, headers, partition_key) VALUES (?, ?, ?, ?, ?)"
	// The walk: the pending rows in partition-key order from a cursor (the
	// head index, published_at IS NULL its first column, so the scan stops
	// at the LIMIT), a page at a time, each partition's first row its head
	// (its oldest unpublished message), with whether the head is ready. A
	// plain read; the ready heads are then locked.
	ready := "(next_attempt_at IS NULL OR next_attempt_at <= NOW(6)) AND (lease_until IS NULL OR lease_until <= NOW(6))"
	// The page is read from the index alone; only its heads are looked up.
	walk := "SELECT h.partition_key, h.seq, h.n, " + strings.ReplaceAll(strings.ReplaceAll(ready, "next_attempt_at", "o.next_attempt_at"), "lease_until", "o.lease_until") + " FROM (\n" +
		"  SELECT w.partition_key, MIN(w.seq) AS seq, COUNT(*) AS n FROM (\n" +
		"    SELECT partition_key, seq FROM " + t + " FORCE INDEX (head_idx) WHERE published_at IS NULL AND partition_key %s ?%s ORDER BY partition_key, seq LIMIT ?) w\n" +
		"  GROUP BY w.partition_key) h\n" +
		"JOIN " + t + " o ON o.seq = h.seq ORDER BY h.partition_key"
	o.walkSQL = [2][2]string{
		{fmt.Sprintf(walk, ">", ""), fmt.Sprintf(walk, ">", " AND partition_key <= ?")},
		{fmt.Sprintf(walk, ">=", ""), fmt.Sprintf(walk, ">=", " AND partition_key <= ?")},
	}
	o.lockHeadsSQL = "SELECT seq FROM " + t + " WHERE seq IN (%s) AND published_at IS NULL AND " + strings.ReplaceAll(ready, "%", "%%") + " FOR UPDATE SKIP LOCKED"
	// Behind a locked head, the messages that follow it in its partition
	// (up to ? of them, by the partition index), with whether each is free;
	// Lease keeps them while they are (a run). One such subquery per head.
	// A locking read: another relay's lease of one of them (its head, once
	// transactions overlapped) may be uncommitted, and a plain read would
	// take the row as free, and the UPDATE lease it twice.
	o.runSQL = "(SELECT partition_key, seq, lease_until IS NULL OR lease_until <= NOW(6) FROM " + t + " FORCE INDEX (partition_idx) WHERE partition_key = ? AND published_at IS NULL AND seq > ? ORDER BY seq LIMIT ? FOR UPDATE)"
	o.leaseSQL = "UPDATE " + t + " SET lease_owner = ?, lease_until = NOW(6) + INTERVAL ? MICROSECOND, attempts = attempts + 1 WHERE seq IN (%s) AND published_at IS NULL"
	o.readSQL = "SELECT seq, id, subject, payload, headers, partition_key, CAST(ROUND(UNIX_TIMESTAMP(enqueued_at) * 1000000) AS SIGNED), attempts - 1 FROM " + t + " WHERE seq IN (%s) AND lease_owner = ? AND published_at IS NULL ORDER BY seq"
	o.markSQL = "UPDATE " + t + " SET published_at = NOW(6), lease_owner = NULL, lease_until = NULL WHERE seq IN (%s) AND lease_owner = ? AND published_at IS NULL"
	o.retrySQL = "UPDATE " + t + " SET lease_owner = NULL, lease_until = NULL, next_attempt_at = NOW(6) + INTERVAL ? MICROSECOND, last_error = ? WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deadInsertSQL = "INSERT INTO " + d + " (" + cols + ", reason) SELECT " + cols + ", ? FROM " + t + " WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deadLockSQL = "SELECT 1 FROM " + t + " WHERE seq = ? AND lease_owner = ? AND published_at IS NULL FOR UPDATE"
	o.deadDeleteSQL = "DELETE FROM " + t + " WHERE seq = ? AND lease_owner = ? AND published_at IS NULL"
	o.deleteSQL = "DELETE FROM " + t + " WHERE published_at IS NOT NULL AND published_at < NOW(6) - INTERVAL ? MICROSECOND ORDER BY published_at LIMIT ?"
	o.statsSQL = "SELECT (SELECT COUNT(*) FROM " + t + " WHERE published_at IS NULL), " +
		"(SELECT COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(enqueued_at), NOW(6)), 0) FROM " + t + " WHERE published_at IS NULL), " +
		"(SELECT COUNT(*) FROM " + d + ")"
	return o, nil
}

// Table returns the outbox table's name, quoted.
func (o *Outbox) Table() string { return o.table }

// Migrate creates the outbox and dead-letter tables if they do not exist,
// and adds the index Lease walks the partitions by (head_idx) to an outbox
// table an earlier release created (an online ALTER TABLE ... ADD INDEX: it
// reads the table once, and needs the ALTER privilege).
func (o *Outbox) Migrate(ctx context.Context) error {
	ddl := []string{
		`CREATE TABLE IF NOT EXISTS ` + o.table + ` (
  seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
  id VARBINARY(255) NOT NULL,
  subject VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  payload LONGBLOB NOT NULL,
  headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
  partition_key VARBINARY(255) NOT NULL,
  enqueued_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  attempts INT NOT NULL DEFAULT 0,
  next_attempt_at TIMESTAMP(6) NULL DEFAULT NULL,
  lease_owner VARBINARY(255) NULL DEFAULT NULL,
  lease_until TIMESTAMP(6) NULL DEFAULT NULL,
  last_error TEXT CHARACTER SET utf8mb4 NULL,
  published_at TIMESTAMP(6) NULL DEFAULT NULL,
  KEY pending_idx (published_at, seq),
  KEY partition_idx (partition_key, published_at, seq),
  KEY head_idx (published_at, partition_key, seq)
) ENGINE=InnoDB`,
		`CREATE TABLE IF NOT EXISTS ` + o.dead + ` (
  seq BIGINT NOT NULL PRIMARY KEY,
  id VARBINARY(255) NOT NULL,
  subject VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  payload LONGBLOB NOT NULL,
  headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
  partition_key VARBINARY(255) NOT NULL,
  enqueued_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  attempts INT NOT NULL,
  reason TEXT CHARACTER SET utf8mb4 NOT NULL,
  dead_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB`,
	}
	for _, s := range ddl {
		if _, err := o.db.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("mysqloutbox: migrate %s: %w", o.table, err)
		}
	}
	// head_idx, on a table created before it (MySQL has no ADD INDEX IF
	// NOT EXISTS). Two Migrates at once: the second one's ALTER fails (the
	// index is there, error 1061), which it checks.
	has, err := o.hasHeadIndex(ctx)
	if err != nil {
		return err
	}
	if !has {
		if _, err := o.db.ExecContext(ctx, "ALTER TABLE "+o.table+" ADD INDEX head_idx (published_at, partition_key, seq)"); err != nil {
			if has, _ := o.hasHeadIndex(ctx); !has {
				return fmt.Errorf("mysqloutbox: migrate %s: adding index head_idx: %w (the user needs the ALTER privilege on the table)", o.table, err)
			}
		}
	}
	return nil
}

func (o *Outbox) hasHeadIndex(ctx context.Context) (bool, error) {
	rows, err := o.db.QueryContext(ctx, "SHOW INDEX FROM "+o.table+" WHERE Key_name = 'head_idx'")
	if err != nil {
		return false, fmt.Errorf("mysqloutbox: migrate %s: %w", o.table, err)
	}
	n := 0
	for rows.Next() {
		n++
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return false, fmt.Errorf("mysqloutbox: migrate %s: %w", o.table, err)
	}
	return n > 0, nil
}

// Enqueue writes m into the outbox in tx; a nil tx means the transaction of
// the request idem is executing under ctx (mysqlstore.Tx(ctx), or
// mysqlstore.Conn(ctx) when the handler wrote through that). It fills in
// m's defaults and checks it (outbox.Prepare).
//
// Enqueue takes no lock beyond the inserted row's: transactions that
// enqueue into the same partitions, in any order, neither wait for nor
// deadlock with one another. The message's seq is the AUTO_INCREMENT value
// of its INSERT, so a transaction that enqueued earlier but commits later has
// the lower seq: the relay publishes it as soon as it commits (it is then
// its partition's head), after what committed before it. docs/outbox.md says
// exactly what order holds.
func (o *Outbox) Enqueue(ctx context.Context, tx *sql.Tx, m outbox.Message) error {
	var q mysqlstore.Querier = tx
	if tx == nil {
		// The request's *sql.Tx, or, when the handler already wrote through
		// mysqlstore.Conn (the connection-scoped transaction of the
		// single-transaction flow, on which Tx can no longer begin one),
		// that connection: either way the request's transaction.
		if t := mysqlstore.Tx(ctx); t != nil {
			q = t
		} else if c := mysqlstore.Conn(ctx); c != nil && !isNilTx(c) {
			q = c
		} else {
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
			return fmt.Errorf("mysqloutbox: encode headers: %w", err)
		}
		headers = sql.NullString{String: string(b), Valid: true}
	}
	if _, err := q.ExecContext(ctx, o.insertSQL, m.ID, m.Subject, m.Payload, headers, m.PartitionKey); err != nil {
		return fmt.Errorf("mysqloutbox: enqueue into %s: %w", o.table, err)
	}
	return nil
}

// isNilTx reports whether q is a nil *sql.Tx (what Conn returns when Tx
// failed to begin one).
func isNilTx(q mysqlstore.Querier) bool {
	t, ok := q.(*sql.Tx)
	return ok && t == nil
}

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?,", n), ",")
}

func seqArgs(seqs []int64) []any {
	a := make([]any, len(seqs))
	for i, s := range seqs {
		a[i] = s
	}
	return a
}

// maxBatch bounds the sequence numbers one statement names: the server
// refuses a statement of more than 65,535 placeholders (error 1390).
const maxBatch = 10000

// Lease implements outbox.Source. It leases at most 10,000 messages at a
// time, whatever n.
func (o *Outbox) Lease(ctx context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	out, err := o.lease(ctx, owner, min(n, maxBatch), d)
	if err != nil && strings.Contains(err.Error(), "head_idx") {
		return nil, fmt.Errorf("mysqloutbox: lease: %w (run Migrate: it adds the index head_idx to a table an earlier release created)", err)
	}
	if err != nil {
		return nil, fmt.Errorf("mysqloutbox: lease: %w", err)
	}
	return out, nil
}

// maxWalk (plus 4 per message asked for) bounds the partitions one Lease
// walks each way from its cursor; walkPage is the pending rows one statement
// of the walk reads (so a walk over partitions of one message reads
// walkPage heads a statement, over longer partitions fewer, down to one),
// and a walk makes at most 16 + n statements each way.
const (
	maxWalk  = 200
	walkPage = 64
)

// runChunk is the most heads one statement reads the runs of.
const runChunk = 500

// head is a partition's oldest unpublished message, as the walk found it.
type head struct {
	part  string
	seq   int64
	ready bool
}

// walk reads the heads of the partitions with a key after from (at or after
// it, when inclusive) and, when upTo is set, at most *upTo, in key order,
// until want ready ones or limit partitions. It returns the ready heads and
// the last partition walked, and whether it stopped at a bound (rather than
// at the end of the keys).
func (o *Outbox) walk(ctx context.Context, from string, inclusive bool, upTo *string, want, limit int) (ready []head, last *string, full bool, err error) {
	walked := 0
	// A statement walks at least one partition (a long one fills a page
	// alone): at most 16 + want statements each way.
	for pages := 0; walked < limit && len(ready) < want; pages++ {
		if pages >= 16+want {
			return ready, last, true, nil
		}
		var rows *sql.Rows
		incl := 0
		if inclusive {
			incl = 1
		}
		if upTo != nil {
			rows, err = o.db.QueryContext(ctx, o.walkSQL[incl][1], from, *upTo, walkPage)
		} else {
			rows, err = o.db.QueryContext(ctx, o.walkSQL[incl][0], from, walkPage)
		}
		if err != nil {
			return nil, nil, false, err
		}
		got := 0 // the page's rows
		prev := ""
		for rows.Next() {
			var h head
			var part []byte
			var rowsOf int
			if err := rows.Scan(&part, &h.seq, &rowsOf, &h.ready); err != nil {
				rows.Close()
				return nil, nil, false, err
			}
			h.part = string(part)
			got += rowsOf
			prev = h.part
			if walked >= limit || len(ready) >= want {
				continue
			}
			walked++
			p := h.part
			last = &p
			if h.ready {
				ready = append(ready, h)
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return nil, nil, false, err
		}
		if got < walkPage {
			return ready, last, walked >= limit, nil // the end of the keys
		}
		// The next page from after the last partition seen (its head was
		// the page's first row of it).
		from, inclusive = prev, false
	}
	return ready, last, walked >= limit, nil
}

func (o *Outbox) lease(ctx context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	o.mu.Lock()
	cursor := o.cursor
	o.mu.Unlock()
	// Round robin: from after the cursor to the end of the partition
	// keys, then from the start up to the cursor (with it), each way at
	// most maxWalk + 4n partitions. The cost is the partitions walked (and walkPage rows a
	// statement), not the messages queued behind their heads.
	limit := maxWalk + 4*n
	found, last, full, err := o.walk(ctx, cursor, false, nil, n, limit)
	if err != nil {
		return nil, err
	}
	frontier := last
	if len(found) < n {
		more, lastBefore, _, err := o.walk(ctx, "", true, &cursor, n-len(found), limit)
		if err != nil {
			return nil, err
		}
		found = append(found, more...)
		if !full && lastBefore != nil {
			frontier = lastBefore
		}
	}
	next := cursor
	switch {
	case len(found) < n:
		// Fewer than n found: the next lease goes on from where this walk
		// stopped, so heads waiting for a retry are walked over once per
		// turn, not once per lease.
		if frontier != nil {
			next = *frontier
		}
	default:
		// From after the last partition found in the walk's order (after
		// a wrap-around, one before the cursor: the largest key found would
		// give the partitions at the start of the keys a second turn).
		next = found[len(found)-1].part
	}
	o.mu.Lock()
	o.cursor = next
	o.mu.Unlock()
	if len(found) == 0 {
		return nil, nil
	}
	cand := make([]int64, len(found))
	partOf := make(map[int64]string, len(found))
	for i, h := range found {
		cand[i] = h.seq
		partOf[h.seq] = h.part
	}
	tx, err := o.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	heads, err := querySeqs(ctx, tx, fmt.Sprintf(o.lockHeadsSQL, placeholders(len(cand))), seqArgs(cand)...)
	if err != nil || len(heads) == 0 {
		return nil, err
	}
	pick := heads
	if need := n - len(heads); need > 0 && maxRun > 0 {
		// Behind each locked head, its run (the free messages that follow
		// it, at most maxRun, and no more than the lease has room for);
		// every head kept, then the runs' messages in seq order up to n in
		// all.
		run := min(maxRun, need)
		var behind []int64
		for i := 0; i < len(heads); i += runChunk {
			chunk := heads[i:min(len(heads), i+runChunk)]
			q := make([]string, len(chunk))
			args := make([]any, 0, 3*len(chunk))
			for j, h := range chunk {
				q[j] = o.runSQL
				args = append(args, partOf[h], h, run)
			}
			rows, err := tx.QueryContext(ctx, strings.Join(q, " UNION ALL "), args...)
			if err != nil {
				return nil, err
			}
			// Each subquery's rows come in seq order: a partition's run
			// ends at its first row not free.
			blocked := map[string]bool{}
			for rows.Next() {
				var part []byte
				var seq int64
				var free bool
				if err := rows.Scan(&part, &seq, &free); err != nil {
					rows.Close()
					return nil, err
				}
				if !free {
					blocked[string(part)] = true
				}
				if !blocked[string(part)] {
					behind = append(behind, seq)
				}
			}
			if err := errors.Join(rows.Err(), rows.Close()); err != nil {
				return nil, err
			}
		}
		slices.Sort(behind)
		pick = append([]int64(nil), heads...)
		for _, s := range behind {
			if len(pick) >= n {
				break
			}
			pick = append(pick, s)
		}
	}
	args := append([]any{owner, d.Microseconds()}, seqArgs(pick)...)
	if _, err := tx.ExecContext(ctx, fmt.Sprintf(o.leaseSQL, placeholders(len(pick))), args...); err != nil {
		return nil, err
	}
	rows, err := tx.QueryContext(ctx, fmt.Sprintf(o.readSQL, placeholders(len(pick))), append(seqArgs(pick), owner)...)
	if err != nil {
		return nil, err
	}
	var out []outbox.Stored
	for rows.Next() {
		var s outbox.Stored
		var id, part []byte
		var headers sql.NullString
		var enq int64
		if err := rows.Scan(&s.Seq, &id, &s.Subject, &s.Payload, &headers, &part, &enq, &s.Attempts); err != nil {
			rows.Close()
			return nil, err
		}
		s.ID, s.PartitionKey, s.EnqueuedAt = string(id), string(part), time.UnixMicro(enq)
		if headers.Valid {
			if err := json.Unmarshal([]byte(headers.String), &s.Headers); err != nil {
				rows.Close()
				return nil, fmt.Errorf("headers of message %d: %w", s.Seq, err)
			}
		}
		out = append(out, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	return out, nil
}

type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

func querySeqs(ctx context.Context, q querier, query string, args ...any) ([]int64, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var s int64
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// MarkPublished implements outbox.Source.
func (o *Outbox) MarkPublished(ctx context.Context, owner string, seqs ...int64) (int, error) {
	total := 0
	for len(seqs) > 0 {
		chunk := seqs[:min(len(seqs), maxBatch)]
		seqs = seqs[len(chunk):]
		args := append(seqArgs(chunk), owner)
		res, err := o.db.ExecContext(ctx, fmt.Sprintf(o.markSQL, placeholders(len(chunk))), args...)
		if err != nil {
			return total, fmt.Errorf("mysqloutbox: mark published: %w", err)
		}
		n, _ := res.RowsAffected()
		total += int(n)
	}
	return total, nil
}

// Retry implements outbox.Source.
func (o *Outbox) Retry(ctx context.Context, owner string, seq int64, retryIn time.Duration, reason string) error {
	if _, err := o.db.ExecContext(ctx, o.retrySQL, retryIn.Microseconds(), clean(reason), seq, owner); err != nil {
		return fmt.Errorf("mysqloutbox: retry: %w", err)
	}
	return nil
}

// DeadLetter implements outbox.Source.
func (o *Outbox) DeadLetter(ctx context.Context, owner string, seq int64, reason string) error {
	tx, err := o.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("mysqloutbox: dead-letter: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// The row locked first: INSERT … SELECT at READ COMMITTED reads it
	// without a lock, and another relay could take the lease (after it
	// lapsed) between the copy and the DELETE, leaving the message in both
	// tables.
	var one int
	err = tx.QueryRowContext(ctx, o.deadLockSQL, seq, owner).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return nil // no longer this owner's
	}
	if err != nil {
		return fmt.Errorf("mysqloutbox: dead-letter: %w", err)
	}
	if _, err := tx.ExecContext(ctx, o.deadInsertSQL, clean(reason), seq, owner); err != nil {
		return fmt.Errorf("mysqloutbox: dead-letter: %w", err)
	}
	if _, err := tx.ExecContext(ctx, o.deadDeleteSQL, seq, owner); err != nil {
		return fmt.Errorf("mysqloutbox: dead-letter: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("mysqloutbox: dead-letter: %w", err)
	}
	return nil
}

// DeletePublished implements outbox.Source.
func (o *Outbox) DeletePublished(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	// At READ COMMITTED: no gap locks that would hold up the handlers'
	// inserts (whose NULL published_at sorts just before the range).
	tx, err := o.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, fmt.Errorf("mysqloutbox: delete published: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	res, err := tx.ExecContext(ctx, o.deleteSQL, olderThan.Microseconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("mysqloutbox: delete published: %w", err)
	}
	n, _ := res.RowsAffected()
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("mysqloutbox: delete published: %w", err)
	}
	return int(n), nil
}

// Stats implements outbox.Source.
func (o *Outbox) Stats(ctx context.Context) (outbox.Stats, error) {
	var s outbox.Stats
	var us int64
	if err := o.db.QueryRowContext(ctx, o.statsSQL).Scan(&s.Pending, &us, &s.DeadLetters); err != nil {
		return s, fmt.Errorf("mysqloutbox: stats: %w", err)
	}
	s.OldestPending = time.Duration(us) * time.Microsecond
	return s, nil
}

// DeadLetter is a dead-lettered message as DeadLetters reads it
// (outbox.DeadLetter, the same for every store).
type DeadLetter = outbox.DeadLetter

// DeadLetters returns up to limit dead-lettered messages, oldest first.
func (o *Outbox) DeadLetters(ctx context.Context, limit int) ([]DeadLetter, error) {
	rows, err := o.db.QueryContext(ctx, "SELECT seq, id, subject, payload, headers, partition_key, CAST(ROUND(UNIX_TIMESTAMP(enqueued_at) * 1000000) AS SIGNED), attempts, reason, CAST(ROUND(UNIX_TIMESTAMP(dead_at) * 1000000) AS SIGNED) FROM "+o.dead+" ORDER BY seq LIMIT ?", limit)
	if err != nil {
		return nil, fmt.Errorf("mysqloutbox: dead letters: %w", err)
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var d DeadLetter
		var id, part []byte
		var headers sql.NullString
		var enq, dead int64
		if err := rows.Scan(&d.Seq, &id, &d.Subject, &d.Payload, &headers, &part, &enq, &d.Attempts, &d.Reason, &dead); err != nil {
			return nil, fmt.Errorf("mysqloutbox: dead letters: %w", err)
		}
		d.ID, d.PartitionKey = string(id), string(part)
		d.EnqueuedAt, d.DeadAt = time.UnixMicro(enq), time.UnixMicro(dead)
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
	tx, err := o.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, fmt.Errorf("mysqloutbox: redrive: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	n := 0
	for _, seq := range seqs {
		var one int
		err := tx.QueryRowContext(ctx, "SELECT 1 FROM "+o.dead+" WHERE seq = ? FOR UPDATE", seq).Scan(&one)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("mysqloutbox: redrive: %w", err)
		}
		if _, err := tx.ExecContext(ctx, "INSERT INTO "+o.table+" (id, subject, payload, headers, partition_key, enqueued_at) SELECT id, subject, payload, headers, partition_key, enqueued_at FROM "+o.dead+" WHERE seq = ?", seq); err != nil {
			return 0, fmt.Errorf("mysqloutbox: redrive: %w", err)
		}
		if _, err := tx.ExecContext(ctx, "DELETE FROM "+o.dead+" WHERE seq = ?", seq); err != nil {
			return 0, fmt.Errorf("mysqloutbox: redrive: %w", err)
		}
		n++
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("mysqloutbox: redrive: %w", err)
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
