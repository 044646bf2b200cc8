package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
	"github.com/idemkit/idem/pgstore"
)

// TestStepStore runs the step-record checks against PostgreSQL, each on a
// fresh table of a private schema.
func TestStepStore(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 24)
	steptest.Run(t, func(t *testing.T) steptest.Store { return db.newStore(t) }, steptest.Options{Resolution: time.Microsecond})
}

// beginFinish begins and finishes step name under owner (fenced on the
// request record when holder), failing the test unless both end within 3
// seconds: they must not wait for a transaction open on another connection.
func beginFinish(t *testing.T, s idem.StepStore, scope, key, name, owner string, holder bool, now time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	start := time.Now()
	_, began, err := s.BeginStep(ctx, idem.BeginStepRequest{
		Scope: scope, Key: key, Name: name, Owner: owner, Holder: holder, Rerun: true,
		DerivedKey: "idem_" + randomHex(16), Now: now, ExpiresAt: now.Add(time.Hour),
	})
	if err != nil || !began {
		t.Fatalf("BeginStep while a transaction is open: began %v, %v (after %v)", began, err, time.Since(start))
	}
	if err := s.FinishStep(ctx, scope, key, name, owner, idem.StepDone, []byte(`{"id":"ch_1"}`), now); err != nil {
		t.Fatalf("FinishStep while a transaction is open: %v (after %v)", err, time.Since(start))
	}
}

// TestStepInsideHandlerTx: in the claim-then-complete flow, at every isolation
// level, a step is begun (fenced on the request record) and finished while
// the handler's transaction (pgstore.Tx) is open and has read and written,
// without waiting for it; the transaction then completes the record and
// commits: the FOR SHARE lock the fence took on the record row is no
// concurrent update to a REPEATABLE READ or SERIALIZABLE transaction.
func TestStepInsideHandlerTx(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, level := range isolationLevels {
		t.Run(strings.ReplaceAll(level, " ", "_"), func(t *testing.T) {
			s, _ := isoStore(t, db, level)
			ctx := ctx30(t)
			now := time.Now()
			scope, key, tok := "tenant", "key-"+randomHex(4), "tok-"+randomHex(8)
			if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v1:x", Token: tok,
				Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
				t.Fatalf("claim: %v %v", ok, err)
			}
			txctx, tx, err := s.BeginTx(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			ptx := pgstore.Tx(txctx)
			var n int
			if err := ptx.QueryRow(txctx, "SELECT count(*) FROM "+s.Table()).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if _, err := ptx.Exec(txctx, "CREATE TEMP TABLE orders_"+randomHex(4)+" (id int)"); err != nil {
				t.Fatal(err)
			}
			beginFinish(t, s, scope, key, "charge", tok, true, now.Add(time.Second))
			beginFinish(t, s, scope, key, "ship", tok, true, now.Add(2*time.Second))
			if err := tx.Complete(txctx, scope, key, tok, &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(time.Hour)); err != nil {
				t.Fatalf("complete in the handler's transaction after the steps: %v", err)
			}
			if err := tx.Commit(txctx); err != nil {
				t.Fatalf("commit after the steps: %v", err)
			}
			recs, err := s.GetSteps(ctx, scope, key, now.Add(3*time.Second))
			if err != nil || len(recs) != 2 || recs[0].State != idem.StepDone || recs[1].State != idem.StepDone {
				t.Fatalf("steps after the commit: %+v, %v", recs, err)
			}
		})
	}
}

// TestStepInsideLockedTx: in the single-transaction flow, a step is recorded
// while the locked transaction (BeginLocked, holding the key's lock) is open,
// without waiting for it, and stays recorded when that transaction rolls
// back (the step record commits on its own).
func TestStepInsideLockedTx(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	ctx := ctx30(t)
	now := time.Now()
	scope, key := "tenant", "key-"+randomHex(4)
	txctx, tx, rec, err := s.BeginLocked(ctx, scope, key, now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked: %v %v", rec, err)
	}
	if _, err := pgstore.Tx(txctx).Exec(txctx, "CREATE TEMP TABLE orders_x (id int)"); err != nil {
		t.Fatal(err)
	}
	beginFinish(t, s, scope, key, "charge", "exec-1", false, now)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	recs, err := s.GetSteps(ctx, scope, key, now)
	if err != nil || len(recs) != 1 || recs[0].State != idem.StepDone || string(recs[0].Result) != `{"id":"ch_1"}` {
		t.Fatalf("steps after the rollback: %+v, %v", recs, err)
	}
}

// TestStepTableNames: the step table is the records table's name with
// "_steps", in its schema; names too long for that get a hashed name of
// their own, distinct for distinct records tables.
func TestStepTableNames(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s, err := pgstore.New(db.pool, &pgstore.Config{Table: db.schema + ".billing"})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := s.StepsTable(), `"`+db.schema+`"."billing_steps"`; got != want {
		t.Fatalf("StepsTable = %s, want %s", got, want)
	}
	long1, long2 := strings.Repeat("a", 62)+"1", strings.Repeat("a", 62)+"2"
	var tables []string
	for _, name := range []string{long1, long2} {
		s, err := pgstore.New(db.pool, &pgstore.Config{Table: db.schema + "." + name})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx30(t)); err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx30(t)); err != nil {
			t.Fatalf("second Migrate: %v", err)
		}
		tables = append(tables, s.StepsTable())
		steptestBegin(t, s)
	}
	if tables[0] == tables[1] {
		t.Fatalf("two long records tables share the step table %s", tables[0])
	}
	if n := db.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, db.schema); n != 4 {
		t.Fatalf("%d tables in the schema, want 4 (two records tables, two step tables)", n)
	}
}

func steptestBegin(t *testing.T, s *pgstore.Store) {
	t.Helper()
	now := time.Now()
	if _, began, err := s.BeginStep(ctx30(t), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o",
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatalf("BeginStep on %s: %v %v", s.StepsTable(), began, err)
	}
}

// TestStepMissingTableSaysMigrate: without Migrate, a step says what to do.
func TestStepMissingTableSaysMigrate(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s, err := pgstore.New(db.pool, &pgstore.Config{Table: db.table("records")})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	_, _, err = s.BeginStep(ctx30(t), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o",
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)})
	if err == nil || !strings.Contains(err.Error(), "Migrate") || errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep without the table = %v, want advice to migrate", err)
	}
}

// BenchmarkStep: a step's first BeginStep (fenced), FinishStep and a replay's
// BeginStep, per op.
func BenchmarkStep(b *testing.B) {
	db := newTestDB(b, 4)
	steptest.Bench(b, db.newStore(b))
}

// TestStepReplayWritesNothing: a BeginStep that finds the step done (and
// would not move its expiry) writes nothing: the row keeps its version (xmin)
// and is not even locked (xmax 0), holder fence or not; one that moves the
// expiry writes.
func TestStepReplayWritesNothing(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	ctx := ctx30(t)
	now := time.Now()
	tok := "tok-" + randomHex(8)
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
	version := func() string {
		var v string
		if err := db.pool.QueryRow(ctx, `SELECT xmin::text || '/' || xmax::text FROM `+s.StepsTable()).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	before := version()
	for _, holder := range []bool{true, false} {
		req.Holder = holder
		if rec, began, err := s.BeginStep(ctx, req); err != nil || began || rec.State != idem.StepDone {
			t.Fatalf("replay: %+v %v %v", rec, began, err)
		}
		if after := version(); after != before || !strings.HasSuffix(after, "/0") {
			t.Fatalf("replay (holder %v) changed the row's xmin/xmax from %s to %s", holder, before, after)
		}
	}
	req.ExpiresAt = now.Add(2 * time.Hour)
	if rec, began, err := s.BeginStep(ctx, req); err != nil || began || !rec.ExpiresAt.Equal(req.ExpiresAt) {
		t.Fatalf("replay with a later expiry: %+v %v %v", rec, began, err)
	}
	if after := version(); after == before {
		t.Fatalf("a later expiry left the row at %s", after)
	}
}

// TestStepHTTP: idem.Step in a handler over loopback HTTP, in both flows,
// records the step while the handler's transaction is open and has written,
// and the retry after an answer not kept gets the recorded result without
// calling the provider again (steptest.HTTP).
func TestStepHTTP(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 8)
	orders := db.schema + ".step_orders"
	db.exec(t, `CREATE TABLE `+orders+` (cart text)`)
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprint(flow), func(t *testing.T) {
			steptest.HTTP(t, db.newStore(t), flow, func(ctx context.Context) error {
				_, err := pgstore.Tx(ctx).Exec(ctx, `INSERT INTO `+orders+` VALUES ('c1')`)
				return err
			})
		})
	}
}
