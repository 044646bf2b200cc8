package pgstore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore/internal/deadsession"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultTable is the table used when Config.Table is empty.
const DefaultTable = "idem_records"

// Config configures a Store. A nil *Config means all defaults. New copies it; the
// caller's struct is never modified.
type Config struct {
	// Table is the table that holds the records: a plain name ("idem_records") or a
	// schema-qualified one ("billing.idem_records"). Each part is an SQL
	// identifier of letters, digits and underscores, at most 63 bytes, quoted as
	// written (so it is case-sensitive). Defaults to "idem_records".
	Table string

	// SynchronousClaim makes the in-flight claim wait for its commit to be flushed
	// to disk (and to synchronous standbys). By default the claim commits with
	// synchronous_commit off, which saves one WAL flush per request and is safe:
	// the completion commits synchronously, and WAL is flushed in order, so a
	// durable completion implies a durable claim; a claim lost in a database crash
	// only lets a retry execute at once instead of after the lease, which it would
	// do anyway once the dead holder's lease lapsed. Defaults to false.
	SynchronousClaim bool
}

// Store is an idem.Store, idem.TxStore and idem.SingleTxStore on PostgreSQL. It is
// safe for concurrent use. Create it with New and the table with Migrate.
type Store struct {
	pool      *pgxpool.Pool
	table     string // quoted, possibly schema-qualified
	index     string // quoted, unqualified name of the expires_at index
	lockNS    []byte // mixed into advisory lock keys, so that tables do not share locks
	syncClaim bool
	listen    *listener // the LISTEN connection of idem.OutcomeNotifier
	// fastArgs: the pool's connections learn parameter types from the server
	// (statements described or prepared), so the single-transaction flow may
	// pass its parameters as the allocation-free types of args.go; in
	// QueryExecModeExec and the simple protocol pgx picks the types from the
	// Go values instead, so plain []byte, string and time.Time are passed.
	fastArgs bool

	claimSQL, selectSQL, getSQL, completeSQL, releaseSQL, extendSQL string
	completeAndCommitSQL                                            string
	deleteSQL, lockSQL, lookupSQL, insertSQL                        string
	heldSQL, lockedSQL                                              string
	insertAndCommitSQL, insertFreshSQL                              string
	insertFreshPlainSQL                                             string

	steps stepSQL // the step records' table and statements (steps.go)
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// New returns a Store that keeps records in cfg.Table of the database pool
// connects to. It does not touch the database: call Migrate (or apply Migrations
// with your migration tool) before the first request.
func New(pool *pgxpool.Pool, cfg *Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("pgstore: pool is nil; pass a *pgxpool.Pool, for example from pgxpool.New(ctx, databaseURL)")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	parts := strings.Split(c.Table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("pgstore: Config.Table %q has %d dots; use a table name or schema.table", c.Table, len(parts)-1)
	}
	for _, p := range parts {
		if !identRE.MatchString(p) || len(p) > 63 {
			return nil, fmt.Errorf("pgstore: Config.Table %q is not a plain or schema-qualified SQL identifier; use letters, digits and underscores (at most 63 bytes per part), not starting with a digit, for example \"idem_records\" or \"billing.idem_records\"", c.Table)
		}
	}
	idx := parts[len(parts)-1] + "_expires_at_idx"
	if len(idx) > 63 {
		idx = idx[:63]
	}
	s := &Store{
		pool:      pool,
		table:     pgx.Identifier(parts).Sanitize(),
		index:     pgx.Identifier{idx}.Sanitize(),
		lockNS:    []byte(c.Table),
		syncClaim: c.SynchronousClaim,
		listen:    newListener(pool, c.Table),
	}
	switch pool.Config().ConnConfig.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec:
		s.fastArgs = true
	}
	s.buildSQL()
	s.buildStepSQL(parts)
	return s, nil
}

// Table returns the quoted, possibly schema-qualified name of the records table,
// ready to be put into SQL.
func (s *Store) Table() string { return s.table }

const cols = `state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted, ref`

// lockKeyExpr is lockKey computed by PostgreSQL from a row's scope and key
// columns (prefixed with alias and a dot when alias is set).
func (s *Store) lockKeyExpr(alias string) string {
	ns := fmt.Sprintf(`'\x%x'::bytea`, s.lockNS)
	col := func(c string) string {
		if alias == "" {
			return c
		}
		return alias + "." + c
	}
	return `('x' || encode(substring(sha256(int8send(` + fmt.Sprint(len(s.lockNS)) + `::int8) || ` + ns +
		` || int8send(length(` + col("scope") + `)::int8) || ` + col("scope") +
		` || int8send(length(` + col("key") + `)::int8) || ` + col("key") + `) from 1 for 8), 'hex'))::bit(64)::int8`
}

func (s *Store) buildSQL() {
	t := s.table
	// claimSQL decides every race in one statement. cur is the live record that
	// cannot be claimed at $5 as the statement's snapshot sees it; when there is
	// one, nothing is written (a replay or a 409 costs no write). Otherwise the
	// INSERT … ON CONFLICT decides: it locks a conflicting row and re-checks the
	// WHERE on its latest version, so exactly one of concurrent claims wins. When it
	// returns no row, a concurrent claim won after the snapshot; Claim then reads
	// the row.
	//
	// An in-flight record whose key's advisory lock ($8) another session holds
	// is never claimable, lapsed or expired as it may look: its holder's
	// transaction is running (BeginTx takes the lock for the handler's
	// transaction, and renewals then leave the row alone, see Extend). The
	// lock is tried, inside the claim's transaction, only for a record that
	// would otherwise be claimable (CASE fixes the order).
	s.claimSQL = `WITH cur AS (
	SELECT ` + cols + ` FROM ` + t + `
	WHERE scope = $1 AND key = $2
	  AND NOT CASE WHEN expires_at <= $5 OR (state = 1 AND lease_until <= $5 AND fingerprint = $3)
		THEN state <> 1 OR pg_try_advisory_xact_lock_shared($8, $9) ELSE false END
), ins AS (
	INSERT INTO ` + t + ` AS r (scope, key, state, fingerprint, token, created_at, lease_until, expires_at)
	SELECT $1::bytea, $2::bytea, 1, $3::bytea, $4::text, $5::timestamptz, $6::timestamptz, $7::timestamptz
	WHERE NOT EXISTS (SELECT FROM cur)
	ON CONFLICT (scope, key) DO UPDATE SET
		state = 1, fingerprint = excluded.fingerprint, token = excluded.token,
		created_at = CASE WHEN r.expires_at <= excluded.created_at THEN excluded.created_at ELSE r.created_at END,
		lease_until = excluded.lease_until, expires_at = excluded.expires_at,
		status = NULL, headers = NULL, body = NULL, body_omitted = false, ref = NULL
	WHERE CASE WHEN r.expires_at <= excluded.created_at
	   OR (r.state = 1 AND r.lease_until <= excluded.created_at AND r.fingerprint = excluded.fingerprint)
		THEN r.state <> 1 OR pg_try_advisory_xact_lock_shared($8, $9) ELSE false END
	RETURNING ` + cols + `
)
SELECT true, * FROM ins
UNION ALL
SELECT false, * FROM cur`
	s.selectSQL = `SELECT ` + cols + ` FROM ` + t + ` WHERE scope = $1 AND key = $2`
	s.getSQL = `SELECT ` + cols + ` FROM ` + t + ` WHERE scope = $1 AND key = $2 AND expires_at > $3`
	s.completeSQL = `UPDATE ` + t + ` SET state = 2, status = $4, headers = $5, body = $6, body_omitted = $7, ref = $8, expires_at = $9
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 1`
	// completeAndCommitSQL is the fenced completion sent in one round trip with
	// COMMIT: when the fence does not match, 1/0 raises division_by_zero, the
	// transaction aborts, and the COMMIT queued behind it is never executed.
	s.completeAndCommitSQL = `WITH done AS (` + s.completeSQL + ` RETURNING 1) SELECT 1 / count(*) FROM done`
	s.releaseSQL = `DELETE FROM ` + t + ` WHERE scope = $1 AND key = $2 AND token = $3 AND state = 1`
	// extendSQL leaves the row alone while another session holds the key's
	// advisory lock: the handler's transaction does (BeginTx), and an UPDATE
	// committed after its snapshot would make its completion fail with a
	// serialization failure under REPEATABLE READ and SERIALIZABLE. The lock
	// is the proof of life then; Extend tells the two apart.
	s.extendSQL = `UPDATE ` + t + ` SET lease_until = $4, expires_at = GREATEST(expires_at, $4) WHERE scope = $1 AND key = $2 AND token = $3 AND state = 1
	AND pg_try_advisory_xact_lock_shared($5, $6)`
	s.heldSQL = `SELECT EXISTS (SELECT FROM ` + t + ` WHERE scope = $1 AND key = $2 AND token = $3 AND state = 1)`
	s.lockedSQL = `SELECT NOT pg_try_advisory_xact_lock_shared($1, $2)`
	// deleteSQL skips in-flight records whose handler's transaction holds the
	// key's lock: their expiry is not renewed meanwhile.
	s.deleteSQL = `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + t + ` WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
)) AND expires_at <= $1 AND (state <> 1 OR pg_try_advisory_xact_lock_shared((` + s.lockKeyExpr("") + ` >> 32)::int4, ((` + s.lockKeyExpr("") + ` << 32) >> 32)::int4))`
	// lockSQL tries the key's lock only when no record is live at $4: a request
	// that will replay (or answer 409 or 422 from) a live record must not hold
	// the lock while it reads, or a request whose clock has passed the record's
	// expiry — for which the key is free — would hear 409 with nothing running.
	s.lockSQL = `SELECT CASE WHEN EXISTS (SELECT FROM ` + t + ` WHERE scope = $2 AND key = $3 AND expires_at > $4)
THEN false ELSE pg_try_advisory_xact_lock($1) END`
	// lookupSQL reads the record whether or not it expired at $3 (its first
	// column says), so that the insert at commit knows whether a row is there to
	// replace; the body of an expired record is not sent.
	s.lookupSQL = `SELECT expires_at > $3, state, fingerprint, token, created_at, lease_until, expires_at, status, headers,
	CASE WHEN expires_at > $3 THEN body END, body_omitted, ref
FROM ` + t + ` WHERE scope = $1 AND key = $2`
	s.insertSQL = `INSERT INTO ` + t + ` AS r (scope, key, ` + cols + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
ON CONFLICT (scope, key) DO UPDATE SET
	state = excluded.state, fingerprint = excluded.fingerprint, token = excluded.token,
	created_at = excluded.created_at, lease_until = excluded.lease_until, expires_at = excluded.expires_at,
	status = excluded.status, headers = excluded.headers, body = excluded.body,
	body_omitted = excluded.body_omitted, ref = excluded.ref
WHERE r.expires_at <= $14`
	// insertAndCommitSQL is the record insert sent in one round trip with COMMIT
	// when BeginLocked found an expired record: when a live record holds the key
	// by then, 1/0 aborts the transaction and the COMMIT behind it is never
	// executed.
	s.insertAndCommitSQL = `WITH ins AS (` + s.insertSQL + ` RETURNING 1) SELECT 1 / count(*) FROM ins`
	// insertFreshSQL is the record insert sent with COMMIT when BeginLocked found
	// no record at all, the common case: a plain INSERT, cheaper than the upsert.
	// A record that appeared meanwhile (a claim-then-complete request) makes it
	// fail with unique_violation, which aborts the transaction in the same way.
	s.insertFreshSQL = `INSERT INTO ` + t + ` (scope, key, ` + cols + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)`
	// insertFreshPlainSQL is insertFreshSQL for the usual record: complete,
	// with its body, without a ref. Those three columns are constants in the
	// statement rather than parameters that pgx encodes and PostgreSQL decodes.
	s.insertFreshPlainSQL = `INSERT INTO ` + t + ` (scope, key, ` + cols + `)
VALUES ($1, $2, 2, $3, $4, $5, $6, $7, $8, $9, $10, false, NULL)`
}

// PreferredFlow implements idem.FlowPreferrer: the single-transaction flow, which
// costs a first-time request three round trips (BEGIN, lock and record read
// pipelined; the handler's statements; record insert and COMMIT pipelined) and
// one commit, against four round trips and two commits in claim-then-complete.
// Set idem.Config.Flow to idem.FlowClaimComplete for routes whose handlers call
// outside services.
func (s *Store) PreferredFlow() idem.Flow { return idem.FlowSingleTx }

// Bounds of the scope and key pgstore stores. The primary key index holds at
// most about 2,700 bytes per entry; idem.New hands stores scopes of at most 128
// bytes and keys of at most 255.
const (
	maxScopeBytes = 1024
	maxKeyBytes   = 1024
)

// maxBytea is the most a bytea (fingerprint, body, ref) holds; maxJSONB the
// most a jsonb value (the headers) does.
const (
	maxBytea = 1<<30 - 1
	maxJSONB = 1<<28 - 1
)

// checkIDs refuses a scope or key longer than pgstore stores, with an error
// (idem.ErrFieldTooLarge) that says so without echoing them.
func checkIDs(_, scope, key string) error {
	if err := idem.CheckFieldSize("pgstore", "scope", int64(len(scope)), maxScopeBytes); err != nil {
		return err
	}
	return idem.CheckFieldSize("pgstore", "key", int64(len(key)), maxKeyBytes)
}

// checkResponse refuses a response, its headers encoded as hdr, that a column
// cannot hold.
func checkResponse(resp *idem.Response, hdr []byte) error {
	if err := idem.CheckFieldSize("pgstore", "headers", int64(len(hdr)), maxJSONB); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("pgstore", "body", int64(len(resp.Body)), maxBytea); err != nil {
		return err
	}
	return idem.CheckFieldSize("pgstore", "ref", int64(len(resp.Ref)), maxBytea)
}

// quoteShort quotes s for an error message, cut to its first 64 bytes.
func quoteShort(s string) string {
	const limit = 64
	if len(s) <= limit {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q… (%d bytes)", s[:limit], len(s))
}

// maxClaimRounds bounds how often Claim retries when the record it lost to
// vanished before it could be read.
const maxClaimRounds = 16

// Claim implements idem.Store.
func (s *Store) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if err := checkIDs("claim", req.Scope, req.Key); err != nil {
		return nil, false, err
	}
	if err := idem.CheckFieldSize("pgstore", "fingerprint", int64(len(req.Fingerprint)), maxBytea); err != nil {
		return nil, false, err
	}
	scope, key, fp := []byte(req.Scope), []byte(req.Key), []byte(req.Fingerprint)
	hi, lo := liveLock(s.lockKey(req.Scope, req.Key))
	for range maxClaimRounds {
		var claimed bool
		row := scanRecord{Record: &idem.Record{Scope: req.Scope, Key: req.Key}}
		err := s.claimOnce(ctx, append([]any{&claimed}, row.scanTargets()...),
			scope, key, fp, req.Token, req.Now, req.LeaseUntil, req.ExpiresAt, hi, lo)
		if err == nil {
			if err := row.finish(); err != nil {
				return nil, false, err
			}
			if claimed {
				// Hand back the caller's own times, not their microsecond-truncated
				// copies, so that a fresh claim's CreatedAt equals req.Now (the
				// middleware tells takeovers by CreatedAt.Before(now)).
				if row.CreatedAt.Equal(req.Now.Truncate(time.Microsecond)) {
					row.CreatedAt = req.Now
				}
				row.LeaseUntil, row.ExpiresAt = req.LeaseUntil, req.ExpiresAt
			}
			return row.Record, claimed, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			if !isServerAnswer(err) && ctx.Err() == nil {
				// The claim's answer was lost (the connection broke after it was
				// sent): PostgreSQL may still be running it, and commit it after
				// the caller's release of the failed claim found nothing, leaving
				// the key in flight under a token nobody holds. Wait, briefly,
				// until the claim has landed or is seen not to, so that the
				// release that follows finds it.
				s.settleLostClaim(ctx, scope, key, req.Token)
			}
			return nil, false, s.wrap("claim", err)
		}
		// A concurrent claim won after this statement's snapshot was taken: read
		// what it wrote.
		rec, err := s.read(ctx, s.pool, s.selectSQL, scope, key)
		if errors.Is(err, idem.ErrNotFound) {
			continue // released or deleted meanwhile: claim again
		}
		if err != nil {
			return nil, false, s.wrap("claim: read the existing record", err)
		}
		if !rec.ExpiresAt.After(req.Now) || (rec.State == idem.StateInFlight && !rec.LeaseUntil.After(req.Now) && rec.Fingerprint == req.Fingerprint) {
			if rec.State == idem.StateInFlight && s.heldByTx(ctx, req.Scope, req.Key) {
				return rec, false, nil // its handler's transaction runs
			}
			continue // claimable at req.Now after all: claim again
		}
		return rec, false, nil
	}
	return nil, false, fmt.Errorf("pgstore: claim of key %s lost %d races in a row to records that vanished; the key is contended, retry later", quoteShort(req.Key), maxClaimRounds)
}

// settleLostClaim waits up to lostClaimSettle, reading on connections of the
// pool, until the record of (scope, key) carries token (the lost claim
// committed: the caller's release will find it). It gives up at once when the
// record cannot be read (the server is unreachable: the release cannot reach
// it either), and after lostClaimSettle when the claim never lands (it never
// reached the server, or lost to another request). It never fails: the release
// after it is best effort anyway.
func (s *Store) settleLostClaim(ctx context.Context, scope, key []byte, token string) {
	ctx, cancel := context.WithTimeout(ctx, lostClaimSettle)
	defer cancel()
	delay := 5 * time.Millisecond
	for {
		rec, err := s.read(ctx, s.pool, s.selectSQL, scope, key)
		if err == nil && rec.Token == token {
			return
		}
		if err != nil && !errors.Is(err, idem.ErrNotFound) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 200*time.Millisecond)
	}
}

// lostClaimSettle bounds settleLostClaim: how long a claim whose answer was
// lost is given to land before its release is tried.
const lostClaimSettle = 2 * time.Second

// claimOnce runs the claim statement and scans its row into dest, in a
// transaction of its own at READ COMMITTED, whatever the session's default
// (the statement is made for it: ON CONFLICT decides the races, and a claim
// at SERIALIZABLE would lose serialization conflicts to other keys' requests),
// pipelined in one round trip: BEGIN; SET LOCAL …; claim; COMMIT. Unless
// Config.SynchronousClaim is set, it commits with synchronous_commit off.
func (s *Store) claimOnce(ctx context.Context, dest []any, args ...any) error {
	for tries := 0; ; tries++ {
		first, err := s.claimRound(ctx, dest, args...)
		if !s.retryDead(ctx, first, tries) {
			return err
		}
	}
}

// claimRound is one try of claimOnce; first is the error of the round trip's
// first statement (its BEGIN).
func (s *Store) claimRound(ctx context.Context, dest []any, args ...any) (first, err error) {
	b := &pgx.Batch{}
	b.Queue(beginRC)
	if !s.syncClaim {
		b.Queue("set local synchronous_commit to off")
	}
	b.Queue(s.claimSQL, args...)
	b.Queue("commit")
	br := s.pool.SendBatch(ctx, b)
	_, err = br.Exec()
	first = err
	if err == nil && !s.syncClaim {
		_, err = br.Exec()
	}
	if err == nil {
		err = br.QueryRow().Scan(dest...)
		if errors.Is(err, pgx.ErrNoRows) {
			if _, cerr := br.Exec(); cerr != nil {
				err = cerr
			}
		} else if err == nil {
			_, err = br.Exec()
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return first, err
}

// beginRC begins a transaction of idem's own statements at READ COMMITTED,
// whatever the session's default isolation.
const beginRC = "begin isolation level read committed"

// execRC runs one statement of idem's own in a transaction at READ COMMITTED
// (beginRC), pipelined in one round trip with its BEGIN and COMMIT: under a
// SERIALIZABLE session default, a single-row statement of idem's would
// otherwise take part in the serialization conflicts of the handlers'
// transactions.
func (s *Store) execRC(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	for tries := 0; ; tries++ {
		tag, first, err := s.execRCRound(ctx, sql, args...)
		if !s.retryDead(ctx, first, tries) {
			return tag, err
		}
	}
}

// execRCRound is one try of execRC; first is the error of its BEGIN.
func (s *Store) execRCRound(ctx context.Context, sql string, args ...any) (tag pgconn.CommandTag, first, err error) {
	b := &pgx.Batch{}
	b.Queue(beginRC)
	b.Queue(sql, args...)
	b.Queue("commit")
	br := s.pool.SendBatch(ctx, b)
	_, err = br.Exec()
	first = err
	if err == nil {
		tag, err = br.Exec()
	}
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, first, err
}

// idleSessionEnded reports whether err says that the session had ended while
// idle, before it read the statement that got err: PostgreSQL ended it by
// idle_session_timeout (57P05).
func idleSessionEnded(err error) bool {
	if err == nil {
		return false // no allocation on success (see deadsession.Is)
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && deadsession.Severity(pgErr) == "FATAL" && pgErr.Code == "57P05"
}

// retryDead reports whether a round trip on the pool whose first statement
// failed with first, after tries retries, is to be sent again
// (deadsession.Retry).
func (s *Store) retryDead(ctx context.Context, first error, tries int) bool {
	return deadsession.Retry(ctx, s.pool, first, tries)
}

// queryRowRetry runs a single-row, read-only query on the pool and scans it
// into dest, sending it again on another connection when its session was dead
// (deadsession.Is).
func (s *Store) queryRowRetry(ctx context.Context, sql string, args []any, dest ...any) error {
	for tries := 0; ; tries++ {
		err := s.pool.QueryRow(ctx, sql, args...).Scan(dest...)
		if !s.retryDead(ctx, err, tries) {
			return err
		}
	}
}

// Complete implements idem.Store.
func (s *Store) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	if err := checkIDs("complete", scope, key); err != nil {
		return err
	}
	return s.complete(ctx, s.pool, scope, key, token, resp, expiresAt)
}

// completeArgs returns the arguments of completeSQL and completeAndCommitSQL.
func completeArgs(scope, key, token string, resp *idem.Response, expiresAt time.Time, fast bool) ([]any, error) {
	if resp == nil {
		return nil, errors.New("pgstore: Complete called with a nil response")
	}
	hdr, err := encodeHeaders(resp.Header)
	if err != nil {
		return nil, err
	}
	if err := checkResponse(resp, hdr); err != nil {
		return nil, err
	}
	return []any{[]byte(scope), []byte(key), token,
		int32(resp.Status), headersParam(hdr, fast), nullableBytes(resp.Body, !resp.BodyOmitted), resp.BodyOmitted, refBytes(resp.Ref), expiresAt}, nil
}

func (s *Store) complete(ctx context.Context, q querier, scope, key, token string, resp *idem.Response, expiresAt time.Time) error {
	args, err := completeArgs(scope, key, token, resp, expiresAt, s.fastArgs)
	if err != nil {
		return err
	}
	tag, err := q.Exec(ctx, s.completeSQL, args...)
	for tries := 0; q == querier(s.pool) && idleSessionEnded(err) && s.retryDead(ctx, err, tries); tries++ {
		// The session had ended before it read the statement: nothing of it
		// ran. (Another FATAL error may have come after the statement
		// committed, on the way to ReadyForQuery.)
		tag, err = q.Exec(ctx, s.completeSQL, args...)
	}
	if err != nil {
		return s.wrap("complete", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, scope, key, token string) error {
	if err := checkIDs("release", scope, key); err != nil {
		return err
	}
	tag, err := s.execRC(ctx, s.releaseSQL, []byte(scope), []byte(key), token)
	if err != nil {
		return s.wrap("release", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// Extend implements idem.Store.
func (s *Store) Extend(ctx context.Context, scope, key, token string, _, leaseUntil time.Time) error {
	if err := checkIDs("extend", scope, key); err != nil {
		return err
	}
	hi, lo := liveLock(s.lockKey(scope, key))
	tag, err := s.execRC(ctx, s.extendSQL, []byte(scope), []byte(key), token, leaseUntil, hi, lo)
	if err != nil {
		return s.wrap("extend", err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	// Nothing changed: the claim is lost, or a transaction holds the key's
	// lock — the handler's own (BeginTx), whose liveness the lock proves.
	var held bool
	if err := s.queryRowRetry(ctx, s.heldSQL, []any{[]byte(scope), []byte(key), token}, &held); err != nil {
		return s.wrap("extend", err)
	}
	if !held {
		return idem.ErrLockLost
	}
	return nil
}

// heldByTx reports whether another session holds the advisory lock of (scope,
// key): the transaction of the handler that holds its claim. An error counts as
// not held.
func (s *Store) heldByTx(ctx context.Context, scope, key string) bool {
	var held bool
	hi, lo := liveLock(s.lockKey(scope, key))
	err := s.queryRowRetry(ctx, s.lockedSQL, []any{hi, lo}, &held)
	return err == nil && held
}

// liveLock is the two-key form of lock key k: the advisory lock a
// claim-then-complete transaction's session holds, exclusively, to prove its
// handler alive (Store.BeginTx). It is not the single transaction's in-flight
// lock (the one-key form of k): the two forms never conflict. The statements
// that ask whether it is held try it shared, so that they never mistake one
// another for a live holder.
func liveLock(k int64) (hi, lo int32) { return int32(k >> 32), int32(k) }

// Get implements idem.Store.
func (s *Store) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	if err := checkIDs("get", scope, key); err != nil {
		return nil, err
	}
	rec, err := s.read(ctx, s.pool, s.getSQL, []byte(scope), []byte(key), now)
	if err != nil && !errors.Is(err, idem.ErrNotFound) {
		return nil, s.wrap("get", err)
	}
	if err == nil && (rec.State != idem.StateInFlight || rec.LeaseUntil.After(now)) {
		return rec, nil
	}
	// Absent, expired, or in flight under a lapsed lease — unless the key's
	// lock is held: its handler's transaction runs, and renewals leave the row
	// alone meanwhile (Extend). Its lease then counts as live.
	if err != nil {
		if rec, err = s.read(ctx, s.pool, s.selectSQL, []byte(scope), []byte(key)); err != nil {
			if errors.Is(err, idem.ErrNotFound) {
				return nil, err
			}
			return nil, s.wrap("get", err)
		}
		if rec.State != idem.StateInFlight {
			return nil, idem.ErrNotFound
		}
	}
	if !s.heldByTx(ctx, scope, key) {
		if !rec.ExpiresAt.After(now) {
			return nil, idem.ErrNotFound
		}
		return rec, nil
	}
	rec.LeaseUntil = now.Add(time.Second)
	if rec.ExpiresAt.Before(rec.LeaseUntil) {
		rec.ExpiresAt = rec.LeaseUntil
	}
	return rec, nil
}

// DeleteExpired implements idem.Store. It deletes at most limit expired records in
// one statement, skipping rows other transactions hold locked.
func (s *Store) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, s.deleteSQL, now, limit)
	if err != nil {
		return 0, s.wrap("delete expired", err)
	}
	return int(tag.RowsAffected()), nil
}

// read runs a query that selects cols and returns the record, or ErrNotFound.
func (s *Store) read(ctx context.Context, q querier, sql string, args ...any) (*idem.Record, error) {
	rec := &idem.Record{Scope: string(args[0].([]byte)), Key: string(args[1].([]byte))}
	row := scanRecord{Record: rec}
	err := q.QueryRow(ctx, sql, args...).Scan(row.scanTargets()...)
	for tries := 0; q == querier(s.pool) && s.retryDead(ctx, err, tries); tries++ {
		err = q.QueryRow(ctx, sql, args...).Scan(row.scanTargets()...)
	}
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, idem.ErrNotFound
		}
		return nil, err
	}
	if err := row.finish(); err != nil {
		return nil, err
	}
	return rec, nil
}

// wrap adds what failed and what to do about a missing table.
func (s *Store) wrap(op string, err error) error {
	if isUndefinedTable(err) {
		return fmt.Errorf("pgstore: %s: table %s does not exist; run Store.Migrate (or apply pgstore.Migrations) first: %w", op, s.table, err)
	}
	return fmt.Errorf("pgstore: %s: %w", op, err)
}
