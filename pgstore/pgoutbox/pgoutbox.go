// Package pgoutbox is the transactional outbox on PostgreSQL: Enqueue writes a
// message into the outbox table in the caller's transaction (the handler's,
// pgstore.Tx), and the Outbox is the outbox.Source an outbox.Relay
// publishes from. Several relays may share one table: the oldest unpublished
// message of each partition (its head) is leased with FOR UPDATE SKIP LOCKED,
// with, behind it, up to 63 of the messages that follow it in the partition
// (a run, which the relay publishes in order), so the order per partition
// holds and a busy partition drains in batches, not one message a round trip.
package pgoutbox

import (
	"context"
	"crypto/sha256"
	"encoding/json"

	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/pgstore/internal/deadsession"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultTable is the outbox table when Config.Table is empty; the dead
// letters go to the table of the same name with "_dead" appended.
const DefaultTable = "idem_outbox"

// Config configures an Outbox. A nil *Config means all defaults.
type Config struct {
	// Table is the outbox table, a plain or schema-qualified name
	// ("billing.idem_outbox") of letters, digits and underscores, quoted as
	// written. Defaults to DefaultTable.
	Table string
	// DeadLetterTable holds the dead-lettered messages with their reason.
	// Defaults to Table with "_dead" appended.
	DeadLetterTable string
	// MaxPayload is the largest payload Enqueue accepts
	// (outbox.DefaultMaxPayload, 1 MiB, by default). Keep it at most what the
	// broker accepts, or larger messages are dead-lettered by the relay.
	MaxPayload int
}

// Outbox is an outbox table on PostgreSQL: Enqueue writes to it, and it is
// the outbox.Source a Relay reads. Safe for concurrent use.
type Outbox struct {
	pool       *pgxpool.Pool
	table      string // quoted
	dead       string // quoted
	lockNS     string
	maxPayload int

	mu     sync.Mutex
	cursor string // the partition key the last lease's walk got to

	insertSQL, leaseSQL, markSQL, retrySQL, deadSQL, deleteSQL, statsSQL string
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func quote(name string) (string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("pgoutbox: table %q: use name or schema.name", name)
	}
	for _, p := range parts {
		if !identRE.MatchString(p) || len(p) > 63 {
			return "", fmt.Errorf("pgoutbox: table %q: each part must be letters, digits and underscores, at most 63 bytes", name)
		}
	}
	return pgx.Identifier(parts).Sanitize(), nil
}

// New returns the Outbox on cfg.Table of pool's database. It does not touch
// the database: call Migrate first.
func New(pool *pgxpool.Pool, cfg *Config) (*Outbox, error) {
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
	o := &Outbox{pool: pool, table: t, dead: d, lockNS: c.Table, maxPayload: c.MaxPayload}
	cols := "seq, id, subject, payload, headers, partition_key, enqueued_at"
	o.insertSQL = "INSERT INTO " + t + " (id, subject, payload, headers, partition_key) VALUES ($1, $2, $3, $4, $5)"
	// The heads: walking the partitions in partition_key order from after a
	// cursor $5 to the end, then from the start up to it, with it (a loose
	// index scan of the pending index: one index descent per partition,
	// each landing on its lowest pending seq, its head), at most $6
	// partitions each way, keeping the first ready heads in the walk's
	// order, at most $3 (ord: their place in it); locked with SKIP LOCKED
	// (a head another relay is leasing right now is its). Then every head
	// kept and, behind each, the messages that follow it in its partition
	// while they are free (a run, up to $4, read FOR UPDATE: a message whose
	// lease by another relay is being committed is waited for and read as
	// that lease left it, so the run stops there instead of leasing it a
	// second time), in seq order, up to $3 in all
	// (a run never takes a found head's place: that head would lose its
	// turn). The cost is the partitions walked (at most 2·$6), not the
	// messages behind their heads. A last row (its frontier column true)
	// names the next cursor: the last partition found in the walk's order
	// (not the largest key: after a wrap-around that would give the first
	// keys a second turn before the rest had one); when fewer than $3 were
	// found, where the walk stopped, so that heads waiting for a retry are
	// walked over once per turn, not once per lease.
	readyOf := func(a string) string {
		return a + ".published_at IS NULL AND " + a + ".next_attempt_at <= now() AND (" + a + ".lease_until IS NULL OR " + a + ".lease_until <= now())"
	}
	walk := func(name, from, step string) string {
		return name + `(partition_key, seq, ready, depth) AS (
  (SELECT p.partition_key, p.seq, ` + readyOf("p") + `, 1 FROM ` + t + ` p WHERE p.published_at IS NULL AND p.partition_key ` + from + ` ORDER BY p.partition_key, p.seq LIMIT 1)
  UNION ALL
  SELECT n.partition_key, n.seq, n.ready, w.depth + 1 FROM ` + name + ` w CROSS JOIN LATERAL (
    SELECT p.partition_key, p.seq, ` + readyOf("p") + ` AS ready FROM ` + t + ` p WHERE p.published_at IS NULL AND p.partition_key > w.partition_key` + step + `
    ORDER BY p.partition_key, p.seq LIMIT 1) n
  WHERE w.depth < $6)`
	}
	ready := readyOf("o")
	o.leaseSQL = `WITH RECURSIVE ` + walk("after", "> $5", "") + `,
` + walk("before", "<= $5", " AND p.partition_key <= $5") + `,
cand AS (
  SELECT seq, partition_key, depth AS ord FROM after WHERE ready
  UNION ALL
  SELECT seq, partition_key, $6 + depth FROM before WHERE ready
  LIMIT $3),
heads AS (
  SELECT o.seq, o.partition_key FROM ` + t + ` o WHERE o.seq IN (SELECT seq FROM cand) AND ` + ready + `
  FOR UPDATE OF o SKIP LOCKED),
runs AS (
  SELECT h.seq AS head, r.seq, r.free FROM heads h CROSS JOIN LATERAL (
    SELECT p.seq, (p.lease_until IS NULL OR p.lease_until <= now()) AS free FROM ` + t + ` p
    WHERE p.partition_key = h.partition_key AND p.published_at IS NULL AND p.seq > h.seq
    ORDER BY p.seq LIMIT $4 FOR UPDATE OF p) r),
pick AS (
  SELECT seq, false AS run FROM heads
  UNION ALL
  SELECT seq, true FROM (SELECT seq, bool_and(free) OVER (PARTITION BY head ORDER BY seq) AS ok FROM runs) x WHERE ok
  ORDER BY run, seq LIMIT $3),
leased AS (
  UPDATE ` + t + ` t SET lease_owner = $1, lease_until = now() + $2 * interval '1 millisecond', attempts = t.attempts + 1
  FROM pick WHERE t.seq = pick.seq AND t.published_at IS NULL
  RETURNING t.seq, t.id, t.subject, t.payload, t.headers, t.partition_key, t.enqueued_at, t.attempts - 1 AS attempts)
SELECT seq, id, subject, payload, headers, partition_key, enqueued_at, attempts, false FROM leased
UNION ALL
SELECT 0, '', '', ''::bytea, NULL, CASE
    WHEN (SELECT count(*) FROM cand) >= $3
    THEN (SELECT partition_key FROM cand ORDER BY ord DESC LIMIT 1)
    WHEN (SELECT max(depth) FROM after) >= $6
    THEN (SELECT partition_key FROM after ORDER BY depth DESC LIMIT 1)
    ELSE (SELECT partition_key FROM before ORDER BY depth DESC LIMIT 1) END, now(), 0, true
`
	o.markSQL = "UPDATE " + t + " SET published_at = now(), lease_owner = NULL, lease_until = NULL WHERE seq = ANY($2) AND lease_owner = $1 AND published_at IS NULL"
	o.retrySQL = "UPDATE " + t + " SET lease_owner = NULL, lease_until = NULL, next_attempt_at = now() + $3 * interval '1 millisecond', last_error = $4 WHERE seq = $2 AND lease_owner = $1 AND published_at IS NULL"
	o.deadSQL = "WITH moved AS (DELETE FROM " + t + " WHERE seq = $2 AND lease_owner = $1 AND published_at IS NULL RETURNING " + cols + ", attempts)\n" +
		"INSERT INTO " + d + " (" + cols + ", attempts, reason) SELECT " + cols + ", attempts, $3 FROM moved"
	o.deleteSQL = "DELETE FROM " + t + " WHERE seq IN (SELECT seq FROM " + t + " WHERE published_at < now() - $1 * interval '1 millisecond' ORDER BY published_at LIMIT $2)"
	o.statsSQL = "SELECT (SELECT count(*) FROM " + t + " WHERE published_at IS NULL), " +
		"(SELECT coalesce(extract(epoch FROM now() - min(enqueued_at))::float8, 0) FROM " + t + " WHERE published_at IS NULL), " +
		"(SELECT count(*) FROM " + d + ")"
	return o, nil
}

// Table returns the outbox table's name, quoted.
func (o *Outbox) Table() string { return o.table }

// Migrate creates the outbox and dead-letter tables and their indexes if
// they do not exist. It is idempotent and safe to run from many processes.
func (o *Outbox) Migrate(ctx context.Context) error {
	idx := func(suffix string) string {
		name := strings.Trim(o.lockNS[strings.LastIndex(o.lockNS, ".")+1:], `"`) + suffix
		if len(name) > 63 {
			sum := sha256.Sum256([]byte(name))
			name = fmt.Sprintf("idem_outbox_%x%s", sum[:6], suffix)
		}
		return pgx.Identifier{name}.Sanitize()
	}
	ddl := []string{
		`CREATE TABLE IF NOT EXISTS ` + o.table + ` (
  seq bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  id text NOT NULL,
  subject text NOT NULL,
  payload bytea NOT NULL,
  headers text,
  partition_key text NOT NULL,
  enqueued_at timestamptz NOT NULL DEFAULT now(),
  attempts integer NOT NULL DEFAULT 0,
  next_attempt_at timestamptz NOT NULL DEFAULT '-infinity',
  lease_owner text,
  lease_until timestamptz,
  last_error text,
  published_at timestamptz)`,
		`CREATE INDEX IF NOT EXISTS ` + idx("_pending_idx") + ` ON ` + o.table + ` (partition_key, seq) WHERE published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS ` + idx("_ready_idx") + ` ON ` + o.table + ` (seq) WHERE published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS ` + idx("_published_idx") + ` ON ` + o.table + ` (published_at) WHERE published_at IS NOT NULL`,
		`CREATE TABLE IF NOT EXISTS ` + o.dead + ` (
  seq bigint PRIMARY KEY,
  id text NOT NULL,
  subject text NOT NULL,
  payload bytea NOT NULL,
  headers text,
  partition_key text NOT NULL,
  enqueued_at timestamptz NOT NULL,
  attempts integer NOT NULL,
  reason text NOT NULL,
  dead_at timestamptz NOT NULL DEFAULT now())`,
	}
	tx, err := o.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("pgoutbox: migrate: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(0x6964656d_6f75746d)); err != nil {
		return fmt.Errorf("pgoutbox: migrate: %w", err)
	}
	for _, s := range ddl {
		if _, err := tx.Exec(ctx, s); err != nil {
			return fmt.Errorf("pgoutbox: migrate %s: %w (does the schema exist, and may this role create tables in it?)", o.table, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgoutbox: migrate: commit: %w", err)
	}
	return nil
}

// Enqueue writes m into the outbox in tx, which commits it or rolls it back
// with the caller's other writes. A nil tx means the transaction of the
// request idem is executing under ctx (pgstore.Tx(ctx)). It fills in m's
// defaults and checks it (outbox.Prepare): without an ID outside a request
// idem executes it fails with outbox.ErrNoID, with a payload over MaxPayload
// with outbox.ErrTooLarge.
//
// Enqueue takes no lock beyond the inserted row's: transactions that
// enqueue into the same partitions, in any order, neither wait for nor
// deadlock with one another. The message's seq comes from the table's
// identity when Enqueue runs, so a transaction that enqueued earlier but
// commits later has the lower seq: the relay publishes it as soon as it
// commits (it is then its partition's head), after what committed before it.
// docs/outbox.md says exactly what order holds.
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, m outbox.Message) error {
	if tx == nil {
		tx = pgstore.Tx(ctx)
		if tx == nil {
			return outbox.ErrNoTx
		}
	}
	m, err := outbox.Prepare(ctx, m, o.maxPayload)
	if err != nil {
		return err
	}
	var headers *string
	if len(m.Headers) > 0 {
		b, err := json.Marshal(m.Headers)
		if err != nil {
			return fmt.Errorf("pgoutbox: encode headers: %w", err)
		}
		s := string(b)
		headers = &s
	}
	if _, err := tx.Exec(ctx, o.insertSQL, m.ID, m.Subject, m.Payload, headers, m.PartitionKey); err != nil {
		return fmt.Errorf("pgoutbox: enqueue into %s: %w", o.table, err)
	}
	return nil
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

// maxRun is the most messages Lease takes behind a head in its partition.
const maxRun = 63

// maxWalk (plus 4 per message asked for) bounds the partitions one Lease
// walks each way from its cursor.
const maxWalk = 200

// Lease implements outbox.Source. It takes the heads partition by
// partition, from after where its previous call stopped (round robin over the
// partitions, wrapping around), not the oldest first: the cost of a lease is
// the partitions it walks, whatever the backlog behind their heads.
func (o *Outbox) Lease(ctx context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	o.mu.Lock()
	cursor := o.cursor
	o.mu.Unlock()
	for tries := 0; ; tries++ {
		out, frontier, err := o.lease(ctx, owner, n, d, cursor)
		if o.retryDead(ctx, err, tries) {
			// Its session had ended: nothing was leased, or (a FATAL error
			// after the lease committed) what was waits for its lease to
			// lapse, never published twice.
			continue
		}
		if err != nil {
			return nil, err
		}
		next := cursor
		if frontier != nil {
			// The next walk starts after it (nil: nothing pending).
			next = *frontier
		}
		o.mu.Lock()
		o.cursor = next
		o.mu.Unlock()
		sortSeq(out)
		return out, nil
	}
}

// lease is one try of Lease, from cursor: the messages and the frontier.
func (o *Outbox) lease(ctx context.Context, owner string, n int, d time.Duration, cursor string) (out []outbox.Stored, frontier *string, _ error) {
	rows, err := o.pool.Query(ctx, o.leaseSQL, owner, ms(d), n, max(0, min(n-1, maxRun)), cursor, maxWalk+4*n)
	if err != nil {
		return nil, nil, fmt.Errorf("pgoutbox: lease: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var s outbox.Stored
		var headers, part *string
		var isFrontier bool
		if err := rows.Scan(&s.Seq, &s.ID, &s.Subject, &s.Payload, &headers, &part, &s.EnqueuedAt, &s.Attempts, &isFrontier); err != nil {
			return nil, nil, fmt.Errorf("pgoutbox: lease: %w", err)
		}
		if isFrontier {
			frontier = part
			continue
		}
		s.PartitionKey = *part
		if headers != nil {
			if err := json.Unmarshal([]byte(*headers), &s.Headers); err != nil {
				return nil, nil, fmt.Errorf("pgoutbox: lease: headers of message %d: %w", s.Seq, err)
			}
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("pgoutbox: lease: %w", err)
	}
	return out, frontier, nil
}

// retryDead reports whether a statement that got err, after tries retries, is
// to be sent again on another connection (deadsession.Retry): its pooled
// session had ended when the statement came. Only the relay's own statements
// are retried, which it may repeat: a lease, a mark, a release or a
// dead-letter of its own lease.
func (o *Outbox) retryDead(ctx context.Context, err error, tries int) bool {
	return deadsession.Retry(ctx, o.pool, err, tries)
}

// exec runs one of the relay's statements on the pool, again on another
// connection when its session was dead (retryDead).
func (o *Outbox) exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	for tries := 0; ; tries++ {
		tag, err := o.pool.Exec(ctx, sql, args...)
		if !o.retryDead(ctx, err, tries) {
			return tag, err
		}
	}
}

func sortSeq(s []outbox.Stored) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j].Seq < s[j-1].Seq; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// MarkPublished implements outbox.Source.
func (o *Outbox) MarkPublished(ctx context.Context, owner string, seqs ...int64) (int, error) {
	if len(seqs) == 0 {
		return 0, nil
	}
	tag, err := o.exec(ctx, o.markSQL, owner, seqs)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: mark published: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// Retry implements outbox.Source.
func (o *Outbox) Retry(ctx context.Context, owner string, seq int64, retryIn time.Duration, reason string) error {
	if _, err := o.exec(ctx, o.retrySQL, owner, seq, ms(retryIn), clean(reason)); err != nil {
		return fmt.Errorf("pgoutbox: retry: %w", err)
	}
	return nil
}

// DeadLetter implements outbox.Source.
func (o *Outbox) DeadLetter(ctx context.Context, owner string, seq int64, reason string) error {
	if _, err := o.exec(ctx, o.deadSQL, owner, seq, clean(reason)); err != nil {
		return fmt.Errorf("pgoutbox: dead-letter: %w", err)
	}
	return nil
}

// DeletePublished implements outbox.Source.
func (o *Outbox) DeletePublished(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	tag, err := o.pool.Exec(ctx, o.deleteSQL, ms(olderThan), limit)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: delete published: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// Stats implements outbox.Source.
func (o *Outbox) Stats(ctx context.Context) (outbox.Stats, error) {
	var s outbox.Stats
	var age float64
	if err := o.pool.QueryRow(ctx, o.statsSQL).Scan(&s.Pending, &age, &s.DeadLetters); err != nil {
		return s, fmt.Errorf("pgoutbox: stats: %w", err)
	}
	s.OldestPending = time.Duration(age * float64(time.Second))
	return s, nil
}

// DeadLetter is a dead-lettered message as DeadLetters reads it
// (outbox.DeadLetter, the same for every store).
type DeadLetter = outbox.DeadLetter

// DeadLetters returns up to limit dead-lettered messages, oldest first.
func (o *Outbox) DeadLetters(ctx context.Context, limit int) ([]DeadLetter, error) {
	rows, err := o.pool.Query(ctx, "SELECT seq, id, subject, payload, headers, partition_key, enqueued_at, attempts, reason, dead_at FROM "+o.dead+" ORDER BY seq LIMIT $1", limit)
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: dead letters: %w", err)
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var d DeadLetter
		var headers *string
		if err := rows.Scan(&d.Seq, &d.ID, &d.Subject, &d.Payload, &headers, &d.PartitionKey, &d.EnqueuedAt, &d.Attempts, &d.Reason, &d.DeadAt); err != nil {
			return nil, fmt.Errorf("pgoutbox: dead letters: %w", err)
		}
		if headers != nil {
			_ = json.Unmarshal([]byte(*headers), &d.Headers)
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// Redrive moves dead-lettered messages back into the outbox, after whatever
// made them unpublishable was repaired (a stream created, a limit raised):
// each gets a new sequence number, at the end of its partition, keeps its
// ID, and is published like a new message. It returns how many it moved.
func (o *Outbox) Redrive(ctx context.Context, seqs ...int64) (int, error) {
	tx, err := o.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: redrive: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	tag, err := tx.Exec(ctx, "WITH moved AS (DELETE FROM "+o.dead+" WHERE seq = ANY($1) RETURNING seq, id, subject, payload, headers, partition_key, enqueued_at)\n"+
		"INSERT INTO "+o.table+" (id, subject, payload, headers, partition_key, enqueued_at) SELECT id, subject, payload, headers, partition_key, enqueued_at FROM moved ORDER BY seq", seqs)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: redrive: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("pgoutbox: redrive: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// clean makes reason storable as text: valid UTF-8 without NUL, at most 4 KiB.
func clean(reason string) string {
	reason = strings.ToValidUTF8(strings.ReplaceAll(reason, "\x00", ""), "?")
	if len(reason) > 4096 {
		reason = strings.ToValidUTF8(reason[:4096], "")
	}
	return reason
}

var _ outbox.Source = (*Outbox)(nil)
