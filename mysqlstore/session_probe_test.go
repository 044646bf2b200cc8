package mysqlstore_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// TestLockFreeAnswersLeaveSessionAsItWas runs testLockFreeAnswersLeaveSessionAsItWas with and without multiStatements (see bothModes).
func TestLockFreeAnswersLeaveSessionAsItWas(t *testing.T) {
	bothModes(t, testLockFreeAnswersLeaveSessionAsItWas)
}

// Whatever BeginLocked answers — a record from the lock-free read (complete,
// or in flight with a lapsed lease), ErrInFlight when another session holds
// the key's lock, none over an expired record — and however the transaction
// ends, the pooled session is as it was: autocommit on, no lock of the key
// held, and its own isolation level for the application's next transaction
// (the guard sets the next transaction's level only when it takes the lock).
func testLockFreeAnswersLeaveSessionAsItWas(t *testing.T) {
	db := openDB(t, 1, "") // one session: whatever leaks stays on it
	s := newStore(t, db)
	otherDB := openDB(t, 2, "")
	other, err := mysqlstore.New(otherDB, &mysqlstore.Config{Table: s.Table()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	orders := ordersTable(t, db)
	ctx := ctxFor(t)
	if _, err := db.ExecContext(ctx, "INSERT INTO `"+orders+"` (id, item) VALUES (1, 'a')"); err != nil {
		t.Fatal(err)
	}
	// readsCommitted reports whether a transaction on db's session sees a
	// row another session committed after the transaction's first read.
	readsCommitted := func() bool {
		t.Helper()
		if _, err := otherDB.ExecContext(ctx, "UPDATE `"+orders+"` SET item = 'a' WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		var v string
		if err := tx.QueryRowContext(ctx, "SELECT item FROM `"+orders+"` WHERE id = 1").Scan(&v); err != nil {
			t.Fatal(err)
		}
		if _, err := otherDB.ExecContext(ctx, "UPDATE `"+orders+"` SET item = 'b' WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRowContext(ctx, "SELECT item FROM `"+orders+"` WHERE id = 1").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v == "b"
	}
	if readsCommitted() {
		t.Skip("the server's default isolation level is READ COMMITTED already: the store's level cannot leak visibly")
	}
	check := func(step, key string) {
		t.Helper()
		var autocommit int
		if err := db.QueryRowContext(ctx, "SELECT @@autocommit").Scan(&autocommit); err != nil || autocommit != 1 {
			t.Fatalf("%s: @@autocommit = %d, %v", step, autocommit, err)
		}
		if readsCommitted() {
			t.Fatalf("%s: the application's next transaction on the session runs at READ COMMITTED (the store's level leaked)", step)
		}
		wantLockFree(t, other, "tenant", key)
		// And the session is outside any transaction: its write is visible at once.
		if _, err := db.ExecContext(ctx, "UPDATE `"+orders+"` SET item = 'c' WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		var v string
		if err := otherDB.QueryRowContext(ctx, "SELECT item FROM `"+orders+"` WHERE id = 1").Scan(&v); err != nil || v != "c" {
			t.Fatalf("%s: a write on the session afterwards is not committed (%q, %v)", step, v, err)
		}
	}
	now := time.Now()

	// A first-time request commits; its replay is answered from the read.
	_, tx, rec, err := s.BeginLocked(ctx, "tenant", "done", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked = %+v, %v", rec, err)
	}
	if err := tx.Insert(ctx, completeRecord("tenant", "done", now, "x")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	check("after Commit", "done")
	_, tx, rec, err = s.BeginLocked(ctx, "tenant", "done", now)
	if err != nil || rec == nil || rec.State != idem.StateComplete {
		t.Fatalf("BeginLocked of a complete record = %+v, %v", rec, err)
	}
	_ = tx.Rollback(ctx)
	check("after a replay's read", "done")

	// The key's lock is held by another session, no record: ErrInFlight.
	_, held, _, err := other.BeginLocked(ctx, "tenant", "held", now)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := s.BeginLocked(ctx, "tenant", "held", now); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("BeginLocked of a held key = %v, want ErrInFlight", err)
	}
	_ = held.Rollback(ctx)
	check("after ErrInFlight", "held")

	// An in-flight record whose lease lapsed is answered from the read.
	lapsed := claimReq("tenant", "lapsed", "v1:lapsed", now.Add(-10*time.Minute))
	if _, claimed, err := other.Claim(ctx, lapsed); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, rec, err = s.BeginLocked(ctx, "tenant", "lapsed", now)
	if err != nil || rec == nil || rec.State != idem.StateInFlight || rec.Token != lapsed.Token {
		t.Fatalf("BeginLocked of a lapsed in-flight record = %+v, %v", rec, err)
	}
	_ = tx.Rollback(ctx)
	check("after a lapsed record's read", "lapsed")

	// An expired record counts as absent; the transaction rolls back.
	if _, claimed, err := other.Claim(ctx, claimReq("tenant", "expired", "v1:old", now.Add(-2*time.Hour))); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, rec, err = s.BeginLocked(ctx, "tenant", "expired", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked over an expired record = %+v, %v", rec, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	check("after Rollback over an expired record", "expired")

}
