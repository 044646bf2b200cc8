package pgstore

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

var _ idem.StepStore = (*Store)(nil)

// stepSQL is the step records' table of a Store and its statements.
type stepSQL struct {
	table string // quoted, qualified as the records table is
	index string // quoted, unqualified name of its expires_at index

	beginSQL, beginHolderSQL, finishSQL, abandonSQL string
	getSQL, settleSQL, forgetSQL, deleteSQL         string
}

// stepTableName is the name of the step records' table of records table
// name: name + "_steps", or, when that is longer than PostgreSQL's 63 bytes,
// a prefix of name, a hash of the whole and "_steps", so that two long names
// never share a table (nor the step table the records table).
func stepTableName(name string) string {
	if n := name + "_steps"; len(n) <= 63 {
		return n
	}
	h := sha256.Sum256([]byte(name))
	return name[:48] + "_" + hex.EncodeToString(h[:4]) + "_steps"
}

func (s *Store) buildStepSQL(parts []string) {
	name := stepTableName(parts[len(parts)-1])
	tparts := append(append([]string{}, parts[:len(parts)-1]...), name)
	idx := name + "_expires_at_idx"
	if len(idx) > 63 {
		h := sha256.Sum256([]byte(name))
		idx = name[:40] + "_" + hex.EncodeToString(h[:4]) + "_exp_idx"
	}
	st := &s.steps
	st.table = pgx.Identifier(tparts).Sanitize()
	st.index = pgx.Identifier{idx}.Sanitize()
	t, r := st.table, s.table

	// beginSQL decides BeginStep in one statement. $6 is the middleware's
	// clock reading. cur is the live record this call may not take and whose
	// expiry it would not move, as the statement's snapshot sees it (with
	// Holder, while the request record is held): when there is one, that is
	// the answer and nothing is written — a replay of a done step costs no
	// write and no commit flush. Otherwise the upsert decides; it always
	// writes (at least the later expiry), so it always returns the row after
	// the decision, and attempt = $9 (a nonce of this call) says whether this
	// call began the step. A conflicting row is locked and the CASEs are
	// evaluated on its latest version, so exactly one of concurrent
	// BeginSteps begins a step.
	//
	// A live row of another request (both fingerprints set, and different:
	// the key released and reused) is cur, whatever else, and the upsert,
	// which meets it only when it came meanwhile, leaves it as it is. With
	// First ($12), oth is a live row of another request under any name of
	// (scope, key) — a range of the primary key (scope, key, name), read in
	// the same statement, so no round trip more — and it is then the answer,
	// nothing written.
	other := `(s.fingerprint <> ''::bytea AND excluded.fingerprint <> ''::bytea AND s.fingerprint <> excluded.fingerprint)`
	take := `(s.expires_at <= $6 OR (NOT ` + other + ` AND s.state = 1 AND (s.owner = '' OR ($10 AND s.owner <> excluded.owner))))`
	expired := `s.expires_at <= $6`
	begin := func(held, guard string) string {
		return `oth AS (
	SELECT state, owner, derived_key, result, started_at, expires_at, fingerprint, name FROM ` + t + `
	WHERE $12 AND $11::bytea <> ''::bytea AND scope = $1 AND key = $2 AND expires_at > $6
	  AND fingerprint <> ''::bytea AND fingerprint <> $11::bytea` + held + `
	LIMIT 1
), cur AS (
	SELECT state, owner, derived_key, result, started_at, expires_at, fingerprint, $3::text FROM ` + t + `
	WHERE scope = $1 AND key = $2 AND name = $3 AND expires_at > $6
	  AND ((fingerprint <> ''::bytea AND $11::bytea <> ''::bytea AND fingerprint <> $11::bytea)
	    OR (expires_at >= $7 AND NOT (state = 1 AND (owner = '' OR ($10 AND owner <> $4)))))` + held + `
	  AND NOT EXISTS (SELECT FROM oth)
), ins AS (
	INSERT INTO ` + t + ` AS s (scope, key, name, state, owner, derived_key, result, started_at, expires_at, attempt, fingerprint)
	SELECT $1::bytea, $2::bytea, $3::text, 1, $4::text, $5::text, NULL, $6::timestamptz, $7::timestamptz, $9::text, $11::bytea
	WHERE CASE WHEN EXISTS (SELECT FROM cur) OR EXISTS (SELECT FROM oth) THEN false ELSE ` + guard + ` END
	ON CONFLICT (scope, key, name) DO UPDATE SET
		attempt = CASE WHEN ` + take + ` THEN excluded.attempt ELSE s.attempt END,
		owner = CASE WHEN ` + take + ` THEN excluded.owner ELSE s.owner END,
		state = CASE WHEN ` + expired + ` THEN 1 ELSE s.state END,
		derived_key = CASE WHEN ` + expired + ` THEN excluded.derived_key ELSE s.derived_key END,
		result = CASE WHEN ` + expired + ` THEN NULL ELSE s.result END,
		started_at = CASE WHEN ` + expired + ` THEN excluded.started_at ELSE s.started_at END,
		fingerprint = CASE WHEN ` + expired + ` THEN excluded.fingerprint ELSE s.fingerprint END,
		expires_at = CASE WHEN ` + expired + ` THEN excluded.expires_at WHEN ` + other + ` THEN s.expires_at ELSE GREATEST(s.expires_at, excluded.expires_at) END
	RETURNING attempt = $9, state, owner, derived_key, result, started_at, expires_at, fingerprint, name
)
SELECT * FROM ins
UNION ALL
SELECT false, * FROM cur
UNION ALL
SELECT false, * FROM oth`
	}
	st.beginSQL = `WITH h AS (SELECT $8::text), ` + begin("", "true")
	// beginHolderSQL is beginSQL fenced on the request record: cur counts
	// only while the record is in flight under the owner and not expired at
	// $6 (in the snapshot), and the upsert writes only when the record is,
	// read FOR SHARE and so locked until the statement commits, so that no
	// takeover commits between the check and the write (a claim's upsert
	// waits the few microseconds for it). A lock, not a write: a handler's
	// REPEATABLE READ transaction that later completes the record does not
	// conflict with it. No row returned: the fence failed.
	held := `SELECT FROM ` + r + ` WHERE scope = $1 AND key = $2 AND state = 1 AND token = $8 AND expires_at > $6`
	st.beginHolderSQL = `WITH h AS (` + held + ` FOR SHARE), ` +
		begin(` AND EXISTS (`+held+`)`, `EXISTS (SELECT FROM h)`)
	live := `scope = $1 AND key = $2 AND name = $3 AND expires_at > $4`
	st.finishSQL = `UPDATE ` + t + ` SET state = $6, result = $7 WHERE ` + live + ` AND state = 1 AND owner = $5 AND owner <> ''`
	st.abandonSQL = `UPDATE ` + t + ` SET owner = '' WHERE ` + live + ` AND state = 1 AND owner = $5 AND owner <> ''`
	st.settleSQL = `UPDATE ` + t + ` SET state = $5, result = $6 WHERE ` + live
	st.forgetSQL = `DELETE FROM ` + t + ` WHERE ` + live
	st.getSQL = `SELECT name, state, owner, derived_key, result, started_at, expires_at, fingerprint FROM ` + t + `
WHERE scope = $1 AND key = $2 AND expires_at > $3 ORDER BY started_at, name`
	st.deleteSQL = `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + t + ` WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
)) AND expires_at <= $1`
}

// StepsTable returns the quoted, possibly schema-qualified name of the step
// records' table (the records table's name with "_steps" appended), ready to
// be put into SQL.
func (s *Store) StepsTable() string { return s.steps.table }

// maxStepText bounds an owner token and a derived key.
const maxStepText = 1024

// checkStepIDs refuses what the step records' columns cannot hold or what no
// caller may pass: NUL bytes in text columns (PostgreSQL refuses them with
// an error that would echo nothing useful), empty or overlong names.
func checkStepIDs(scope, key, name, owner string) error {
	if err := checkIDs("step", scope, key); err != nil {
		return err
	}
	if name == "" {
		return errors.New("pgstore: the step name is empty; name every step")
	}
	if err := idem.CheckFieldSize("pgstore", "step name", int64(len(name)), idem.MaxStepNameLength); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("pgstore", "step owner", int64(len(owner)), maxStepText); err != nil {
		return err
	}
	if strings.IndexByte(name, 0) >= 0 || strings.IndexByte(owner, 0) >= 0 {
		return errors.New("pgstore: a step name or owner contains a NUL byte; use visible ASCII")
	}
	return nil
}

// stepNonce returns a fresh nonce for the attempt column.
func stepNonce() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// queryStep runs one step statement in a transaction of its own at READ
// COMMITTED (whatever the session's default), pipelined in one round trip
// with its BEGIN and COMMIT, and scans its row into dest; found is false when
// it returned no row.
func (s *Store) queryStep(ctx context.Context, sql string, args []any, dest ...any) (found bool, err error) {
	for tries := 0; ; tries++ {
		found, first, err := s.queryStepRound(ctx, sql, args, dest...)
		if !s.retryDead(ctx, first, tries) {
			return found, err
		}
	}
}

// queryStepRound is one try of queryStep; first is the error of its BEGIN
// (see retryDead).
func (s *Store) queryStepRound(ctx context.Context, sql string, args []any, dest ...any) (found bool, first, err error) {
	c, err := s.stepConn(ctx)
	if err != nil {
		return false, nil, err
	}
	defer c.Release()
	b := &pgx.Batch{}
	b.Queue(beginRC)
	b.Queue(sql, args...)
	b.Queue("commit")
	br := c.SendBatch(ctx, b)
	_, err = br.Exec()
	first = err
	if err == nil {
		err = br.QueryRow().Scan(dest...)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return found, first, err
}

// stepAcquireTimeout bounds a step statement's wait for a pool connection.
// A step runs while its handler's transaction holds a connection of the same
// pool: with every connection held by handlers that each wait for a step, no
// wait ends, so it is cut short with an error that says what to do.
const stepAcquireTimeout = 5 * time.Second

// stepConn acquires a pool connection for a step statement, waiting at most
// stepAcquireTimeout.
func (s *Store) stepConn(ctx context.Context) (*pgxpool.Conn, error) {
	actx, cancel := context.WithTimeout(ctx, stepAcquireTimeout)
	defer cancel()
	c, err := s.pool.Acquire(actx)
	if err != nil && ctx.Err() == nil && actx.Err() != nil {
		st := s.pool.Stat()
		return nil, fmt.Errorf("no pool connection came free for the step's statement within %v (%d of MaxConns %d in use, most likely by running handlers' transactions, each waiting for a step): a step needs a connection beside its handler's transaction, so size pgxpool's MaxConns above the requests that run steps at once: %w", stepAcquireTimeout, st.AcquiredConns(), st.MaxConns(), err)
	}
	return c, err
}

// execStep is execRC on a connection from stepConn.
func (s *Store) execStep(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	for tries := 0; ; tries++ {
		tag, first, err := s.execStepRound(ctx, sql, args...)
		if !s.retryDead(ctx, first, tries) {
			return tag, err
		}
	}
}

// execStepRound is one try of execStep; first is the error of its BEGIN.
func (s *Store) execStepRound(ctx context.Context, sql string, args ...any) (tag pgconn.CommandTag, first, err error) {
	c, err := s.stepConn(ctx)
	if err != nil {
		return pgconn.CommandTag{}, nil, err
	}
	defer c.Release()
	b := &pgx.Batch{}
	b.Queue(beginRC)
	b.Queue(sql, args...)
	b.Queue("commit")
	br := c.SendBatch(ctx, b)
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

// BeginStep implements idem.StepStore in one statement and one round trip
// (beginSQL or, with req.Holder, beginHolderSQL).
func (s *Store) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	if err := checkStepIDs(req.Scope, req.Key, req.Name, req.Owner); err != nil {
		return nil, false, err
	}
	if req.DerivedKey == "" || strings.IndexByte(req.DerivedKey, 0) >= 0 {
		return nil, false, errors.New("pgstore: begin step: the derived key is empty or contains a NUL byte")
	}
	if err := idem.CheckFieldSize("pgstore", "step derived key", int64(len(req.DerivedKey)), maxStepText); err != nil {
		return nil, false, err
	}
	sql := s.steps.beginSQL
	if req.Holder {
		sql = s.steps.beginHolderSQL
	}
	rec := &idem.StepRecord{Scope: req.Scope, Key: req.Key, Name: req.Name}
	var began bool
	var state int16
	var fp []byte
	found, err := s.queryStep(ctx, sql,
		[]any{[]byte(req.Scope), []byte(req.Key), req.Name, req.Owner, req.DerivedKey, req.Now, req.ExpiresAt, req.Owner, stepNonce(), req.Rerun, []byte(req.Fingerprint), req.First},
		&began, &state, &rec.Owner, &rec.DerivedKey, &rec.Result, &rec.StartedAt, &rec.ExpiresAt, &fp, &rec.Name)
	if err != nil {
		return nil, false, s.wrapStep("begin step", err)
	}
	if !found {
		return nil, false, idem.ErrLockLost
	}
	rec.State, rec.Fingerprint = idem.StepState(state), string(fp)
	// Hand back the caller's own times, not their microsecond-truncated copies.
	if rec.StartedAt.Equal(req.Now.Truncate(time.Microsecond)) {
		rec.StartedAt = req.Now
	}
	if rec.ExpiresAt.Equal(req.ExpiresAt.Truncate(time.Microsecond)) {
		rec.ExpiresAt = req.ExpiresAt
	}
	return rec, began, nil
}

// FinishStep implements idem.StepStore: one fenced UPDATE.
func (s *Store) FinishStep(ctx context.Context, scope, key, name, owner string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStepIDs(scope, key, name, owner); err != nil {
		return err
	}
	if state != idem.StepDone && state != idem.StepFailed {
		return fmt.Errorf("pgstore: finish step: state %v; a step finishes done or failed", state)
	}
	if err := idem.CheckFieldSize("pgstore", "step result", int64(len(result)), maxBytea); err != nil {
		return err
	}
	if result == nil {
		result = []byte{}
	}
	tag, err := s.execStep(ctx, s.steps.finishSQL, []byte(scope), []byte(key), name, now, owner, int16(state), result)
	if err != nil {
		return s.wrapStep("finish step", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// AbandonStep implements idem.StepStore: one fenced UPDATE.
func (s *Store) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	if err := checkStepIDs(scope, key, name, owner); err != nil {
		return err
	}
	tag, err := s.execStep(ctx, s.steps.abandonSQL, []byte(scope), []byte(key), name, now, owner)
	if err != nil {
		return s.wrapStep("abandon step", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrLockLost
	}
	return nil
}

// GetSteps implements idem.StepStore.
func (s *Store) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	if err := checkIDs("get steps", scope, key); err != nil {
		return nil, err
	}
	for tries := 0; ; tries++ {
		out, err := s.getSteps(ctx, scope, key, now)
		if s.retryDead(ctx, err, tries) {
			continue // a read: sent again on another connection
		}
		if isUndefinedTable(err) {
			return nil, nil // a database not migrated since step records came: none was written
		}
		if err != nil {
			return nil, s.wrapStep("get steps", err)
		}
		return out, nil
	}
}

// getSteps is one try of GetSteps.
func (s *Store) getSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	rows, err := s.pool.Query(ctx, s.steps.getSQL, []byte(scope), []byte(key), now)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []idem.StepRecord
	for rows.Next() {
		rec := idem.StepRecord{Scope: scope, Key: key}
		var state int16
		var fp []byte
		if err := rows.Scan(&rec.Name, &state, &rec.Owner, &rec.DerivedKey, &rec.Result, &rec.StartedAt, &rec.ExpiresAt, &fp); err != nil {
			return nil, err
		}
		rec.State, rec.Fingerprint = idem.StepState(state), string(fp)
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// SettleStep implements idem.StepStore: one UPDATE, or one DELETE for state 0.
func (s *Store) SettleStep(ctx context.Context, scope, key, name string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStepIDs(scope, key, name, ""); err != nil {
		return err
	}
	var sql string
	args := []any{[]byte(scope), []byte(key), name, now}
	switch state {
	case 0:
		sql = s.steps.forgetSQL
	case idem.StepDone, idem.StepFailed:
		if err := idem.CheckFieldSize("pgstore", "step result", int64(len(result)), maxBytea); err != nil {
			return err
		}
		if result == nil {
			result = []byte{}
		}
		sql = s.steps.settleSQL
		args = append(args, int16(state), result)
	default:
		return fmt.Errorf("pgstore: settle step: state %v; settle a step as done or failed, or 0 to forget it", state)
	}
	tag, err := s.execStep(ctx, sql, args...)
	if err != nil {
		return s.wrapStep("settle step", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrNotFound
	}
	return nil
}

// DeleteExpiredSteps implements idem.StepStore: at most limit expired step
// records in one statement, skipping rows other transactions hold locked.
func (s *Store) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, s.steps.deleteSQL, now, limit)
	if isUndefinedTable(err) {
		// A database not migrated since step records came, under a service
		// that records none: nothing to delete, and its janitor sweeps on.
		return 0, nil
	}
	if err != nil {
		return 0, s.wrapStep("delete expired steps", err)
	}
	return int(tag.RowsAffected()), nil
}

// wrapStep is wrap for the step records' table.
func (s *Store) wrapStep(op string, err error) error {
	if isUndefinedTable(err) {
		return fmt.Errorf("pgstore: %s: table %s does not exist; run Store.Migrate (or apply pgstore.Migrations) first: %w", op, s.steps.table, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42703" { // undefined_column
		return fmt.Errorf("pgstore: %s: table %s lacks a column this release writes (fingerprint, from migration 003_steps_fingerprint); run Store.Migrate (or apply pgstore.Migrations) first: %w", op, s.steps.table, err)
	}
	return fmt.Errorf("pgstore: %s: %w", op, err)
}
