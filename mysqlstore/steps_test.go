package mysqlstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
	"github.com/idemkit/idem/mysqlstore"
)

// TestStepStore runs the step-record checks against MySQL/MariaDB, with and
// without multiStatements, each check on a table of its own.
func TestStepStore(t *testing.T) { bothModes(t, testStepStore) }

func testStepStore(t *testing.T) {
	db := openDB(t, 24, "")
	steptest.Run(t, func(t *testing.T) steptest.Store { return newStore(t, db) }, steptest.Options{Resolution: time.Microsecond})
}

// beginFinish begins and finishes step name within 3 seconds: far less than
// innodb_lock_wait_timeout, so that a step waiting for a lock of the open
// transaction fails the test.
func beginFinish(t *testing.T, s *mysqlstore.Store, scope, key, name, owner string, holder bool, now time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	start := time.Now()
	_, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: scope, Key: key, Name: name, Owner: owner, Holder: holder, Rerun: true,
		DerivedKey: randomName("idem_"), Now: now, ExpiresAt: now.Add(time.Hour)})
	if err != nil || !began {
		t.Fatalf("BeginStep while a transaction is open: began %v, %v (after %v)", began, err, time.Since(start))
	}
	if err := s.FinishStep(ctx, scope, key, name, owner, idem.StepDone, []byte(`{"id":"ch_1"}`), now); err != nil {
		t.Fatalf("FinishStep while a transaction is open: %v (after %v)", err, time.Since(start))
	}
}

// TestStepInsideTransactions: steps are begun (the first time and again, so
// that both the INSERT and the upsert path run) and finished while the
// handler's transaction (claim-then-complete, mysqlstore.Tx) or the locked
// transaction (single-transaction flow) is open and has written, without
// waiting for it; the transaction then completes and commits (or rolls back),
// and the step records stay.
func TestStepInsideTransactions(t *testing.T) { bothModes(t, testStepInsideTransactions) }

func testStepInsideTransactions(t *testing.T) {
	db := openDB(t, 6, "")
	s := newStore(t, db)
	orders := randomName("orders_")
	dropAtEnd(t, db, orders)
	ctx := ctxFor(t)
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+orders+"` (id INT PRIMARY KEY) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tok := randomName("tok-")
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "claim", Fingerprint: "v1:x", Token: tok,
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	txctx, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mysqlstore.Tx(txctx).ExecContext(txctx, "INSERT INTO `"+orders+"` VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if _, err := mysqlstore.Tx(txctx).ExecContext(txctx, "SELECT * FROM `"+orders+"` FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	beginFinish(t, s, "s", "other", "charge", "exec-x", false, now) // a step of another key
	beginFinish(t, s, "s", "claim", "charge", tok, true, now)
	// Begun again by the same owner: the upsert path, not began (done).
	if r, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "claim", Name: "charge", Owner: tok, Holder: true,
		DerivedKey: "idem_2", Now: now, ExpiresAt: now.Add(2 * time.Hour)}); err != nil || began || r.State != idem.StepDone {
		t.Fatalf("BeginStep of a done step inside the transaction: %+v %v %v", r, began, err)
	}
	if err := tx.Complete(txctx, "s", "claim", tok, &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(txctx); err != nil {
		t.Fatal(err)
	}

	lctx, ltx, rec, err := s.BeginLocked(ctx, "s", "single", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked: %v %v", rec, err)
	}
	if _, err := mysqlstore.Tx(lctx).ExecContext(lctx, "INSERT INTO `"+orders+"` VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	beginFinish(t, s, "s", "single", "charge", "exec-1", false, now)
	if err := ltx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"claim", "single"} {
		recs, err := s.GetSteps(ctx, "s", key, now)
		if err != nil || len(recs) != 1 || recs[0].State != idem.StepDone {
			t.Fatalf("steps of %s after its transaction: %+v, %v", key, recs, err)
		}
	}
}

// TestStepMissingTableSaysMigrate: without Migrate, a step says what to do.
func TestStepMissingTableSaysMigrate(t *testing.T) {
	t.Parallel()
	db := openDB(t, 2, "")
	s, err := mysqlstore.New(db, &mysqlstore.Config{Table: randomName("idem_none_")})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	_, _, err = s.BeginStep(ctxFor(t), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o",
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)})
	if err == nil || !strings.Contains(err.Error(), "Migrate") || errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep without the table = %v, want advice to migrate", err)
	}
}
