package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestTerminatedWhileClaimWaitsOnRowLock: a claim taking over a lapsed record
// waits for the row lock another transaction holds; its backend is ended by
// pg_terminate_backend while it waits (FATAL 57P01, not as the first answer of
// its round trip: BEGIN has run). The claim must fail (it is not a dead idle
// session, and nothing of it committed), must not hang, and the record must
// stay the first claim's, claimable by the next request once the lock is gone.
// In every query execution mode. Guard: it passed before it was written.
func TestTerminatedWhileClaimWaitsOnRowLock(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) { terminateWaitingClaim(t, db, mode) })
	}
}

func terminateWaitingClaim(t *testing.T, db *testDB, mode pgx.QueryExecMode) {
	name := "idem_test_" + randomHex(6)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	table := db.table("records")
	s, err := pgstore.New(pool, &pgstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "t1", Now: now, LeaseUntil: now.Add(time.Second), ExpiresAt: now.Add(time.Hour)}
	if _, claimed, err := s.Claim(ctx30(t), req); err != nil || !claimed {
		t.Fatalf("first claim: claimed %v, %v", claimed, err)
	}

	// Another transaction holds the record's row lock.
	blocker, err := db.pool.Acquire(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Release()
	btx, err := blocker.Begin(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = btx.Rollback(context.Background()) }()
	if _, err := btx.Exec(ctx30(t), "SELECT 1 FROM "+table+" WHERE key = 'k' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}

	// The lease lapsed at later: the second claim takes over, and waits.
	later := now.Add(2 * time.Second)
	type result struct {
		rec     *idem.Record
		claimed bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		rec, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "t2", Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour)})
		done <- result{rec, claimed, err}
	}()
	var pid int
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := db.pool.QueryRow(ctx30(t), `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, name).Scan(&pid)
		if err == nil {
			break
		}
		if err != pgx.ErrNoRows || time.Now().After(deadline) {
			t.Fatalf("no claim waiting on a lock: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	db.exec(t, "SELECT pg_terminate_backend($1)", pid)

	var r result
	select {
	case r = <-done:
	case <-time.After(15 * time.Second):
		// Retried as if its session had been idle: it waits on the lock again.
		_ = btx.Rollback(context.Background())
		r = <-done
		t.Fatalf("the terminated claim was sent again and waited for the lock (then: claimed %v, %v)", r.claimed, r.err)
	}
	if r.err == nil {
		t.Fatalf("terminated claim: claimed %v, no error; want the FATAL error", r.claimed)
	}
	t.Logf("terminated claim: %v", r.err)
	if err := btx.Rollback(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx30(t), "s", "k", later)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	if rec.Token != "t1" || rec.State != idem.StateInFlight {
		t.Fatalf("record after the terminated claim: token %q state %v; want t1 in flight", rec.Token, rec.State)
	}
	// Not stuck: the next request takes the lapsed record over.
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "t3", Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("claim after: claimed %v, %v", claimed, err)
	}
}
