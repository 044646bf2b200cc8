package mysqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

var _ idem.SingleTxStore = (*mysqlstore.Store)(nil)

func completeRecord(scope, key string, now time.Time, body string) *idem.Record {
	return &idem.Record{
		Scope: scope, Key: key, State: idem.StateComplete, Fingerprint: "v1:single", Token: randomName("tok-"),
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour),
		Response: &idem.Response{Status: 201, Header: http.Header{"Location": {"/x"}}, Body: []byte(body)},
	}
}

// wantLockFree checks, from another pool, that (scope, key) can be locked.
func wantLockFree(t *testing.T, other *mysqlstore.Store, scope, key string) {
	t.Helper()
	ctx, tx, _, err := other.BeginLocked(ctxFor(t), scope, key, time.Now())
	if err != nil {
		t.Fatalf("BeginLocked from another pool: %v; want the lock free", err)
	}
	_ = ctx
	if err := tx.Rollback(ctxFor(t)); err != nil {
		t.Fatal(err)
	}
}

// storePair returns two stores on one table through two pools (two sets of sessions).
func storePair(t *testing.T, conns int) (*mysqlstore.Store, *mysqlstore.Store) {
	a := newStore(t, openDB(t, conns, ""))
	b, err := mysqlstore.New(openDB(t, 2, ""), &mysqlstore.Config{Table: a.Table()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return a, b
}

// TestSingleTx runs testSingleTx with and without multiStatements (see bothModes).
func TestSingleTx(t *testing.T) { bothModes(t, testSingleTx) }

func testSingleTx(t *testing.T) {
	s, other := storePair(t, 4)
	ctx := ctxFor(t)
	now := time.Now()

	tctx, tx, rec, err := s.BeginLocked(ctx, "tenant", "k", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked of an absent key = %v, %v; want no record", rec, err)
	}
	if mysqlstore.Tx(tctx) == nil {
		t.Fatal("Tx(ctx) is nil in a locked transaction")
	}
	for _, st := range []*mysqlstore.Store{s, other} {
		if _, _, _, err := st.BeginLocked(ctx, "tenant", "k", now); !errors.Is(err, idem.ErrInFlight) {
			t.Fatalf("second BeginLocked of a locked key = %v, want ErrInFlight", err)
		}
	}
	// Other keys, and keys that differ only in case, are not locked.
	for _, k := range []string{"K", "k2"} {
		_, tx2, _, err := other.BeginLocked(ctx, "tenant", k, now)
		if err != nil {
			t.Fatalf("BeginLocked(%q) while %q is locked: %v", k, "k", err)
		}
		_ = tx2.Rollback(ctx)
	}
	want := completeRecord("tenant", "k", now, "single")
	if err := tx.Insert(ctx, want); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "tenant", "k", now); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("record visible before Commit: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback after Commit = %v, want nil", err)
	}
	got, err := s.Get(ctx, "tenant", "k", now)
	if err != nil || got.State != idem.StateComplete || got.Token != want.Token || string(got.Response.Body) != "single" {
		t.Fatalf("after Commit Get = %+v, %v", got, err)
	}
	_, tx, rec, err = other.BeginLocked(ctx, "tenant", "k", now)
	if err != nil || rec == nil || rec.Token != want.Token {
		t.Fatalf("BeginLocked after Commit = %+v, %v; want the committed record", rec, err)
	}
	_ = tx.Rollback(ctx)
	// A claim-then-complete request sees the record too.
	if rec, claimed, err := s.Claim(ctx, claimReq("tenant", "k", "v1:single", now)); err != nil || claimed || rec.State != idem.StateComplete {
		t.Fatalf("Claim of a key completed in a single transaction = %+v, %v, %v", rec, claimed, err)
	}
}

// TestSingleTxExpiredAndRaces runs testSingleTxExpiredAndRaces with and without multiStatements (see bothModes).
func TestSingleTxExpiredAndRaces(t *testing.T) { bothModes(t, testSingleTxExpiredAndRaces) }

func testSingleTxExpiredAndRaces(t *testing.T) {
	s, other := storePair(t, 4)
	ctx := ctxFor(t)
	now := time.Now()

	// An expired record counts as absent and is replaced.
	old := claimReq("tenant", "expired", "v1:old", now.Add(-2*time.Hour))
	if _, claimed, err := s.Claim(ctx, old); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, rec, err := s.BeginLocked(ctx, "tenant", "expired", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked over an expired record = %+v, %v; want none", rec, err)
	}
	want := completeRecord("tenant", "expired", now, "new")
	if err := tx.Insert(ctx, want); err != nil {
		t.Fatalf("Insert over an expired record: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get(ctx, "tenant", "expired", now); err != nil || got.Token != want.Token {
		t.Fatalf("Get = %+v, %v; want the new record", got, err)
	}

	// A claim-then-complete request that takes the key meanwhile wins; Insert says so.
	_, tx, rec, err = s.BeginLocked(ctx, "tenant", "raced", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked = %+v, %v", rec, err)
	}
	claim := claimReq("tenant", "raced", "v1:claim", now)
	if _, claimed, err := other.Claim(ctx, claim); err != nil || !claimed {
		t.Fatalf("Claim while locked = %v, %v", claimed, err)
	}
	// The store may defer the write to Commit (the interface allows it), which
	// then reports ErrInFlight and commits nothing.
	err = tx.Insert(ctx, completeRecord("tenant", "raced", now, "loser"))
	if err == nil {
		err = tx.Commit(ctx)
	}
	if !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("Insert and Commit over a live record = %v, want ErrInFlight", err)
	}
	_ = tx.Rollback(ctx)
	if got, err := s.Get(ctx, "tenant", "raced", now); err != nil || got.Token != claim.Token {
		t.Fatalf("Get = %+v, %v; want the claim's record", got, err)
	}
	wantLockFree(t, other, "tenant", "raced")
}

// The lock never outlives its transaction: not after Commit or Rollback, not when
// the request's context ends, and not when the session dies.
// TestSingleTxLockReleased runs testSingleTxLockReleased with and without multiStatements (see bothModes).
func TestSingleTxLockReleased(t *testing.T) { bothModes(t, testSingleTxLockReleased) }

func testSingleTxLockReleased(t *testing.T) {
	s, other := storePair(t, 1) // one connection: a leaked lock would stay on it
	ctx := ctxFor(t)
	for i := range 6 {
		_, tx, _, err := s.BeginLocked(ctx, "tenant", "k", time.Now())
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		if i%2 == 0 {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		wantLockFree(t, other, "tenant", "k")
	}

	// The request's context ends while the transaction is open.
	cctx, cancel := context.WithCancel(ctx)
	_, tx, _, err := s.BeginLocked(cctx, "tenant", "cancelled", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	_ = tx.Rollback(ctx)
	wantLockFree(t, other, "tenant", "cancelled")

	// The session dies (the process crashed, the network dropped it).
	tctx, tx, _, err := s.BeginLocked(ctx, "tenant", "killed", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := mysqlstore.Tx(tctx).QueryRowContext(tctx, "SELECT CONNECTION_ID()").Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := other.BeginLocked(ctx, "tenant", "killed", time.Now()); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("BeginLocked of a held key = %v, want ErrInFlight", err)
	}
	killer := openDB(t, 1, "")
	if _, err := killer.ExecContext(ctx, fmt.Sprintf("KILL %d", id)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, tx2, _, err := other.BeginLocked(ctx, "tenant", "killed", time.Now())
		if err == nil {
			_ = tx2.Rollback(ctx)
			break
		}
		if !errors.Is(err, idem.ErrInFlight) || time.Now().After(deadline) {
			t.Fatalf("BeginLocked after the holder's session was killed: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Error("Commit on a killed session succeeded")
	}
	// The pool is not poisoned by the dead connection.
	if _, tx, _, err := s.BeginLocked(ctx, "tenant", "after", time.Now()); err != nil {
		t.Fatalf("BeginLocked after a killed session: %v", err)
	} else {
		_ = tx.Rollback(ctx)
	}
}
