package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestStepStore runs the step-record checks on a database file (step records
// in the file beside it), each check on a table of its own.
func TestStepStore(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	steptest.Run(t, func(t *testing.T) steptest.Store { return newStore(t, db) }, steptest.Options{Resolution: time.Nanosecond})
	if _, err := os.Stat(filepath.Join(filepath.Dir(mainPath(t, db)), "idem.db"+sqlitestore.StepsFileSuffix)); err != nil {
		t.Fatalf("the step records' file: %v", err)
	}
}

// TestStepStoreInMemory: a shared-cache in-memory records database gets an
// in-memory step database of the process, and writes no file.
func TestStepStoreInMemory(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	db, err := sql.Open(embedded.DriverName, "file:mem"+randomHex(6)+"?mode=memory&cache=shared")
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(4)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	t.Cleanup(func() { _ = db.Close() })
	steptest.Run(t, func(t *testing.T) steptest.Store { return newStore(t, db) }, steptest.Options{Resolution: time.Nanosecond, Concurrency: 8})
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("an in-memory store wrote files: %v", ents)
	}
}

// TestStepsFileOddPath: a records file whose path has the characters of a
// URI's query and fragment gets its steps file beside it, under its own name.
func TestStepsFileOddPath(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "a?b#c%20d.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s := newStore(t, db)
	now := time.Now()
	if _, began, err := s.BeginStep(context.Background(), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o",
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatalf("BeginStep: %v %v", began, err)
	}
	if _, err := os.Stat(path + sqlitestore.StepsFileSuffix); err != nil {
		t.Fatalf("steps file: %v", err)
	}
}

// TestStepStoreTwoHandles: two *sql.DB on one file, as two processes would
// have, begin one step at once: exactly one begins it (the steps file's
// write lock, not the in-process gate, decides across handles).
func TestStepStoreTwoHandles(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	var stores []*sqlitestore.Store
	table := "idem_" + randomHex(6)
	for range 2 {
		db, err := embedded.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := sqlitestore.New(db, &sqlitestore.Config{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		stores = append(stores, s)
	}
	for round := range 20 {
		now := time.Now()
		key := fmt.Sprintf("k%d", round)
		var wg sync.WaitGroup
		var mu sync.Mutex
		began := 0
		release := make(chan struct{})
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-release
				_, ok, err := stores[i%2].BeginStep(context.Background(), idem.BeginStepRequest{
					Scope: "s", Key: key, Name: "charge", Owner: fmt.Sprint("o", i), DerivedKey: "idem_" + randomHex(8),
					Now: now, ExpiresAt: now.Add(time.Hour)})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					t.Errorf("BeginStep: %v", err)
				}
				if ok {
					began++
				}
			}()
		}
		close(release)
		wg.Wait()
		if began != 1 {
			t.Fatalf("round %d: %d of 8 BeginSteps over two handles began the step, want 1", round, began)
		}
	}
}

func mainPath(t *testing.T, db *sql.DB) string {
	t.Helper()
	var seq int
	var name, file string
	if err := db.QueryRow("PRAGMA database_list").Scan(&seq, &name, &file); err != nil {
		t.Fatal(err)
	}
	return file
}

// promptly runs fn with a 3-second context derived from parent and fails the
// test if it does not succeed within it: a step must not wait for the
// handler's transaction.
func promptly(t *testing.T, parent context.Context, what string, fn func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(parent, 3*time.Second)
	defer cancel()
	start := time.Now()
	if err := fn(ctx); err != nil {
		t.Fatalf("%s while the handler's transaction holds the write lock: %v (after %v)", what, err, time.Since(start).Round(time.Millisecond))
	}
}

// stepInTx begins and finishes a step (fenced on the request record when
// holder) within promptly, with a context derived from ctx (the handler's,
// which carries its transaction, as idem.Step passes it).
func stepInTx(t *testing.T, ctx context.Context, s *sqlitestore.Store, key, owner string, holder bool, now time.Time) {
	t.Helper()
	promptly(t, ctx, "BeginStep", func(ctx context.Context) error {
		_, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: key, Name: "charge", Owner: owner, Holder: holder,
			DerivedKey: "idem_" + randomHex(8), Now: now, ExpiresAt: now.Add(time.Hour)})
		if err == nil && !began {
			err = errors.New("did not begin")
		}
		return err
	})
	promptly(t, ctx, "FinishStep", func(ctx context.Context) error {
		return s.FinishStep(ctx, "s", key, "charge", owner, idem.StepDone, []byte(`{"id":"ch_1"}`), now)
	})
}

// TestStepInsideTransaction: a step begun and finished inside a running
// transaction that holds SQLite's write lock completes promptly, in both
// flows: the claim-then-complete flow's handler transaction (BeginTx, with
// the Holder fence reading the request record) and the single-transaction
// flow's locked transaction (BeginLocked). With step records in the records'
// own file (the naive design, or Config.StepsDB on the same file, which New's
// check now refuses), the step waits for the lock the transaction holds: the
// gate's LockTimeout in process, the busy timeout across handles — far more
// than the 3 seconds allowed here. The record survives the transaction's
// rollback.
func TestStepInsideTransaction(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := newStore(t, db)
	ctx := context.Background()
	now := time.Now()
	// Open the step records' database and create its table before any
	// transaction: what is measured is the step's own write.
	if _, err := s.StepsDB(ctx); err != nil {
		t.Fatal(err)
	}

	// Claim-then-complete with the handler's transaction.
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "claim", Fingerprint: "v1:x", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	txctx, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlitestore.Tx(txctx).ExecContext(txctx, "CREATE TABLE orders (id INTEGER)"); err != nil {
		t.Fatal(err)
	}
	stepInTx(t, txctx, s, "claim", "tok", true, now)
	if err := tx.Complete(txctx, "s", "claim", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(txctx); err != nil {
		t.Fatal(err)
	}

	// Single transaction.
	lctx, ltx, rec, err := s.BeginLocked(ctx, "s", "single", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked: %v %v", rec, err)
	}
	if _, err := sqlitestore.Tx(lctx).ExecContext(lctx, "INSERT INTO orders VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	stepInTx(t, lctx, s, "single", "exec-1", false, now)
	if err := ltx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"claim", "single"} {
		recs, err := s.GetSteps(ctx, "s", key, now)
		if err != nil || len(recs) != 1 || recs[0].State != idem.StepDone {
			t.Fatalf("steps of %s after its transaction ended: %+v, %v", key, recs, err)
		}
	}
}

// TestStepsDBSameFileRefused: a Config.StepsDB on the records' own file (or
// the records' own *sql.DB) is refused with an error that says why, instead
// of deadlocking the first step inside a transaction.
func TestStepsDBSameFileRefused(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	again, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = again.Close() })
	other, err := embedded.Open(filepath.Join(t.TempDir(), "steps.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	now := time.Now()
	req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: "n", Owner: "o", DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}
	for name, sdb := range map[string]*sql.DB{"same handle": db, "same file": again} {
		s, err := sqlitestore.New(db, &sqlitestore.Config{StepsDB: sdb})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.BeginStep(context.Background(), req); err == nil || !strings.Contains(err.Error(), "StepsDB") {
			t.Fatalf("%s: BeginStep = %v, want StepsDB refused", name, err)
		}
	}
	s, err := sqlitestore.New(db, &sqlitestore.Config{StepsDB: other})
	if err != nil {
		t.Fatal(err)
	}
	if _, began, err := s.BeginStep(context.Background(), req); err != nil || !began {
		t.Fatalf("BeginStep with a StepsDB of its own: %v %v", began, err)
	}
	var n int
	if err := other.QueryRow(`SELECT count(*) FROM idem_records_steps`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("step records in StepsDB: %d, %v", n, err)
	}
	if _, err := os.Stat(path + sqlitestore.StepsFileSuffix); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("with StepsDB set, the file beside the records' is %v, want absent", err)
	}
}

// TestStepsFileNotCreatedByReads: the janitor and reads of a store that never
// recorded a step do not create the steps file.
func TestStepsFileNotCreatedByReads(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s := newStore(t, db)
	ctx := context.Background()
	if n, err := s.DeleteExpiredSteps(ctx, time.Now(), 100); n != 0 || err != nil {
		t.Fatalf("DeleteExpiredSteps = %d, %v", n, err)
	}
	if recs, err := s.GetSteps(ctx, "s", "k", time.Now()); len(recs) != 0 || err != nil {
		t.Fatalf("GetSteps = %v, %v", recs, err)
	}
	if err := s.SettleStep(ctx, "s", "k", "n", 0, nil, time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("SettleStep = %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(path + sqlitestore.StepsFileSuffix); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("steps file after reads only: %v, want absent", err)
	}
}

// BenchmarkStep: a step's first BeginStep (fenced), FinishStep and a replay's
// BeginStep, per op.
func BenchmarkStep(b *testing.B) {
	steptest.Bench(b, newStore(b, openDB(b)))
}

// TestStepReplayWritesNothing: a BeginStep that finds the step done (the
// expiry not moving) needs no write: it answers while another connection
// holds the steps file's write lock, where a BeginStep that writes waits.
func TestStepReplayWritesNothing(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s := newStore(t, db)
	ctx := context.Background()
	now := time.Now()
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:x", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: "charge", Owner: "tok", Holder: true, Rerun: true,
		DerivedKey: "idem_1", Now: now, ExpiresAt: now.Add(time.Hour)}
	stepInTx(t, ctx, s, "k", "tok", true, now) // begins and finishes "charge"
	other, err := embedded.Open(path + sqlitestore.StepsFileSuffix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	tx, err := other.BeginTx(ctx, nil) // BEGIN IMMEDIATE: the steps file's write lock
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	for _, holder := range []bool{true, false} {
		req.Holder = holder
		promptly(t, ctx, "a replay's BeginStep", func(ctx context.Context) error {
			rec, began, err := s.BeginStep(ctx, req)
			if err == nil && (began || rec.State != idem.StepDone) {
				err = fmt.Errorf("replay: %+v began %v", rec, began)
			}
			return err
		})
	}
	bad := req
	bad.Owner, bad.Holder = "someone-else", true
	if _, _, err := s.BeginStep(ctx, bad); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("fenced-out replay = %v, want ErrLockLost", err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	req.Name = "ship"
	if _, _, err := s.BeginStep(short, req); err == nil {
		t.Fatal("a BeginStep that writes did not wait for the steps file's write lock; the check above proves nothing")
	}
}

// TestStepHTTP: idem.Step in a handler over loopback HTTP, in both flows,
// records the step while the handler's transaction holds the records file's
// write lock (it wrote first), and the retry after an answer not kept gets
// the recorded result without calling the provider again (steptest.HTTP).
func TestStepHTTP(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprint(flow), func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			if _, err := db.Exec(`CREATE TABLE step_orders (cart TEXT)`); err != nil {
				t.Fatal(err)
			}
			steptest.HTTP(t, newStore(t, db), flow, func(ctx context.Context) error {
				_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO step_orders VALUES ('c1')`)
				return err
			})
		})
	}
}

// TestStepsOldTableGetsFingerprint: a steps table made before step records
// carried the request's fingerprint gets the column at the first step; its
// rows keep working (their fingerprint is "", told apart from no request),
// and new rows carry theirs.
func TestStepsOldTableGetsFingerprint(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	sdb, err := embedded.Open(filepath.Join(t.TempDir(), "steps.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sdb.Close() })
	now := time.Now()
	if _, err := sdb.Exec(`CREATE TABLE idem_records_steps (
    scope TEXT NOT NULL, key TEXT NOT NULL, name TEXT NOT NULL,
    state INTEGER NOT NULL CHECK (state IN (1, 2, 3)), owner TEXT NOT NULL, derived_key TEXT NOT NULL,
    result BLOB, started_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, attempt TEXT NOT NULL,
    PRIMARY KEY (scope, key, name));
INSERT INTO idem_records_steps VALUES ('s', 'k', 'old', 2, '', 'idem_old', '1', ?1, ?2, 'x')`, now.UnixNano(), now.Add(time.Hour).UnixNano()); err != nil {
		t.Fatal(err)
	}
	s, err := sqlitestore.New(db, &sqlitestore.Config{StepsDB: sdb})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	const fp = "v3:aa"
	rec, began, err := s.BeginStep(context.Background(), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "old", Owner: "o",
		DerivedKey: "idem_x", Fingerprint: fp, Now: now, ExpiresAt: now.Add(time.Hour)})
	if err != nil || began || rec.State != idem.StepDone || rec.DerivedKey != "idem_old" || rec.Fingerprint != "" {
		t.Fatalf("BeginStep of an old row: %+v %v %v; want it done, with its derived key and no fingerprint", rec, began, err)
	}
	if _, began, err := s.BeginStep(context.Background(), idem.BeginStepRequest{Scope: "s", Key: "k", Name: "new", Owner: "o",
		DerivedKey: "idem_y", Fingerprint: fp, Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatalf("BeginStep of a new step: %v %v", began, err)
	}
	recs, err := s.GetSteps(context.Background(), "s", "k", now)
	if err != nil || len(recs) != 2 {
		t.Fatalf("GetSteps: %+v %v", recs, err)
	}
	for _, r := range recs {
		if want := map[string]string{"old": "", "new": fp}[r.Name]; r.Fingerprint != want {
			t.Errorf("step %s: Fingerprint %q, want %q", r.Name, r.Fingerprint, want)
		}
	}
}
