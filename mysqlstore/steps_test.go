package mysqlstore_test

import (
	"context"
	"errors"
	"fmt"
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

// TestStepStoreSQLModes runs the step checks under MariaDB's
// SIMULTANEOUS_ASSIGNMENT and ORACLE modes, in which every assignment of ON
// DUPLICATE KEY UPDATE sees the old row (see the upsert's ours).
func TestStepStoreSQLModes(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"SIMULTANEOUS_ASSIGNMENT,STRICT_TRANS_TABLES", "ORACLE"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 24, sqlModeDSN(mode))
			var got string
			if err := db.QueryRowContext(ctxFor(t), "SELECT @@SESSION.sql_mode").Scan(&got); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(got, "SIMULTANEOUS_ASSIGNMENT") {
				t.Skipf("the server has no SIMULTANEOUS_ASSIGNMENT mode (sql_mode = %q): not MariaDB", got)
			}
			steptest.Run(t, func(t *testing.T) steptest.Store { return newStore(t, db) }, steptest.Options{Resolution: time.Microsecond})
		})
	}
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

// BenchmarkStep: a step's first BeginStep (fenced), FinishStep and a replay's
// BeginStep, per op.
func BenchmarkStep(b *testing.B) {
	steptest.Bench(b, newStore(b, openDB(b, 4, "")))
}

// TestStepReplayWritesNothing: a BeginStep that finds the step done (and
// would not move its expiry) writes nothing (seq, which every write bumps,
// stays); one that moves the expiry writes.
func TestStepReplayWritesNothing(t *testing.T) {
	t.Parallel()
	db := openDB(t, 4, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	now := time.Now()
	tok := randomName("tok-")
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:x", Token: tok,
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: "charge", Owner: tok, Holder: true, Rerun: true,
		DerivedKey: "idem_1", Now: now, ExpiresAt: now.Add(time.Hour)}
	if _, began, err := s.BeginStep(ctx, req); err != nil || !began {
		t.Fatal(began, err)
	}
	if err := s.FinishStep(ctx, "s", "k", "charge", tok, idem.StepDone, []byte(`1`), now); err != nil {
		t.Fatal(err)
	}
	seq := func() int {
		var n int
		if err := db.QueryRowContext(ctx, "SELECT `seq` FROM `"+s.StepsTable()+"`").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := seq()
	for _, holder := range []bool{true, false} {
		req.Holder = holder
		if rec, began, err := s.BeginStep(ctx, req); err != nil || began || rec.State != idem.StepDone {
			t.Fatalf("replay: %+v %v %v", rec, began, err)
		}
		if after := seq(); after != before {
			t.Fatalf("replay (holder %v) wrote the row (seq %d → %d)", holder, before, after)
		}
	}
	// A fenced-out replay is refused, also on the read path.
	bad := req
	bad.Owner, bad.Holder = "someone-else", true
	if _, _, err := s.BeginStep(ctx, bad); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("fenced-out replay = %v, want ErrLockLost", err)
	}
	req.ExpiresAt = now.Add(2 * time.Hour)
	if rec, began, err := s.BeginStep(ctx, req); err != nil || began || !rec.ExpiresAt.Equal(req.ExpiresAt) {
		t.Fatalf("replay with a later expiry: %+v %v %v", rec, began, err)
	}
	if after := seq(); after == before {
		t.Fatal("a later expiry did not write the row")
	}
}

// TestStepResultOverPacket: a step result that cannot travel in one packet of
// the server's max_allowed_packet is refused as idem.ErrFieldTooLarge (naming
// the step result), on a fresh Store too, and the record stays started, the
// connection usable; one that fits is recorded.
func TestStepResultOverPacket(t *testing.T) {
	t.Parallel()
	db := openDB(t, 2, "")
	ctx := ctxFor(t)
	var maxPacket int
	if err := db.QueryRowContext(ctx, "SELECT @@max_allowed_packet").Scan(&maxPacket); err != nil {
		t.Fatal(err)
	}
	if maxPacket > 64<<20 {
		t.Skipf("max_allowed_packet is %d bytes; the test sends one more", maxPacket)
	}
	s := newStore(t, db)
	now := time.Now()
	if _, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o",
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatal(began, err)
	}
	fresh, err := mysqlstore.New(db, &mysqlstore.Config{Table: s.Table()})
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, maxPacket+1)
	var fte *idem.FieldTooLargeError
	for name, st := range map[string]*mysqlstore.Store{"store": s, "fresh store": fresh} {
		err := st.FinishStep(ctx, "s", "k", "n", "o", idem.StepDone, big, now)
		if !errors.As(err, &fte) || fte.Field != "step result" {
			t.Fatalf("%s: FinishStep with a result over max_allowed_packet = %v, want ErrFieldTooLarge for the step result", name, err)
		}
		if err := st.SettleStep(ctx, "s", "k", "n", idem.StepDone, big, now); !errors.As(err, &fte) {
			t.Fatalf("%s: SettleStep with a result over max_allowed_packet = %v, want ErrFieldTooLarge", name, err)
		}
	}
	recs, err := s.GetSteps(ctx, "s", "k", now)
	if err != nil || len(recs) != 1 || recs[0].State != idem.StepStarted {
		t.Fatalf("after the refusals: %+v, %v", recs, err)
	}
	if err := s.FinishStep(ctx, "s", "k", "n", "o", idem.StepDone, make([]byte, 1<<20), now); err != nil {
		t.Fatalf("FinishStep with a 1 MiB result: %v", err)
	}
}

// TestStepHTTP: idem.Step in a handler over loopback HTTP, in both flows,
// records the step while the handler's transaction is open and has written,
// and the retry after an answer not kept gets the recorded result without
// calling the provider again (steptest.HTTP).
func TestStepHTTP(t *testing.T) { bothModes(t, testStepHTTP) }

func testStepHTTP(t *testing.T) {
	db := openDB(t, 8, "")
	orders := randomName("step_orders_")
	dropAtEnd(t, db, orders)
	if _, err := db.ExecContext(ctxFor(t), "CREATE TABLE `"+orders+"` (cart VARCHAR(10)) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprint(flow), func(t *testing.T) {
			steptest.HTTP(t, newStore(t, db), flow, func(ctx context.Context) error {
				_, err := mysqlstore.Tx(ctx).ExecContext(ctx, "INSERT INTO `"+orders+"` VALUES ('c1')")
				return err
			})
		})
	}
}

// TestStepStoreStatementBinlog runs the step checks on a private MariaDB that
// writes a statement-based binary log, under which InnoDB refuses writes at
// READ COMMITTED and INSERT … SELECT takes shared locks on what it reads.
func TestStepStoreStatementBinlog(t *testing.T) {
	t.Parallel()
	dsn := statementBinlogServer(t)
	db := binlogPool(t, dsn, 24)
	steptest.Run(t, func(t *testing.T) steptest.Store { return newStore(t, db) }, steptest.Options{Resolution: time.Microsecond})
}

// TestStepStoreTxPath runs the step checks with BeginStep of an existing step
// deciding in its transaction (the upsert and read), the path it takes when
// its optimistic one loses every round.
func TestStepStoreTxPath(t *testing.T) {
	t.Parallel()
	db := openDB(t, 24, "")
	steptest.Run(t, func(t *testing.T) steptest.Store {
		s := newStore(t, db)
		mysqlstore.NoStepCAS(s)
		return s
	}, steptest.Options{Resolution: time.Microsecond})
}

// TestStepStoreOwnConn runs the step checks with every step operation on a
// connection of its own, by the statements' text: the path a step takes
// when the pool is full (TestStepPoolExhaustedSaysSo).
func TestStepStoreOwnConn(t *testing.T) {
	t.Parallel()
	db := openDB(t, 24, "")
	for _, cas := range []bool{true, false} {
		t.Run(fmt.Sprintf("cas=%v", cas), func(t *testing.T) {
			steptest.Run(t, func(t *testing.T) steptest.Store {
				s := newStore(t, db)
				mysqlstore.StepOwnConn(s)
				if !cas {
					mysqlstore.NoStepCAS(s)
				}
				return s
			}, steptest.Options{Resolution: time.Microsecond})
		})
	}
}
