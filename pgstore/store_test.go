package pgstore_test

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // lazy: never dialled
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pgstore.New(nil, nil); err == nil || !strings.Contains(err.Error(), "pgxpool") {
		t.Errorf("New(nil pool) = %v, want an error that says to pass a *pgxpool.Pool", err)
	}
	for _, table := range []string{"", "idem_records", "Billing.Idem_2", "s.t", "_x"} {
		s, err := pgstore.New(pool, &pgstore.Config{Table: table})
		if err != nil {
			t.Errorf("New(Table %q): %v", table, err)
			continue
		}
		if table == "" && s.Table() != `"idem_records"` {
			t.Errorf("default table = %s, want \"idem_records\"", s.Table())
		}
	}
	for _, table := range []string{"a.b.c", "1abc", "x;drop table y", `"q"`, "a.", ".a", "a b", "ü", strings.Repeat("x", 64)} {
		if _, err := pgstore.New(pool, &pgstore.Config{Table: table}); err == nil {
			t.Errorf("New(Table %q) succeeded, want an error", table)
		}
	}
	cfg := &pgstore.Config{}
	if _, err := pgstore.New(pool, cfg); err != nil || cfg.Table != "" {
		t.Errorf("New modified the caller's Config: %+v (%v)", cfg, err)
	}
}

func ctx30(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 6)
	s, err := pgstore.New(db.pool, &pgstore.Config{Table: db.table("m")})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 5)
	start := make(chan struct{})
	for i := range errs {
		wg.Go(func() {
			<-start
			errs[i] = s.Migrate(ctx30(t))
		})
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent Migrate: %v", err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	// Catalog tables only: pg_indexes calls pg_get_indexdef, which fails with
	// "could not open relation" when a parallel test drops its schema meanwhile.
	if n := db.count(t, `SELECT count(*) FROM pg_index i
JOIN pg_class c ON c.oid = i.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0]
WHERE n.nspname = $1 AND i.indnatts = 1 AND a.attname = 'expires_at'`, db.schema); n != 2 {
		t.Errorf("%d expires_at indexes in the schema, want 2 (the records' and the step records')", n)
	}
	if _, _, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:x", Token: "t", Now: time.Now(), LeaseUntil: time.Now().Add(time.Minute), ExpiresAt: time.Now().Add(time.Hour)}); err != nil {
		t.Fatalf("Claim on the migrated table: %v", err)
	}
}

// TestMigrationFiles applies the embedded files, as a migration tool would, to
// the default table name.
func TestMigrationFiles(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	var names []string
	_ = fs.WalkDir(pgstore.Migrations, ".", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			names = append(names, p)
		}
		return err
	})
	if strings.Join(names, " ") != "001_create.down.sql 001_create.up.sql 002_create_steps.down.sql 002_create_steps.up.sql 003_steps_fingerprint.down.sql 003_steps_fingerprint.up.sql" {
		t.Fatalf("Migrations holds %v", names)
	}
	conn, err := db.pool.Acquire(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	defer conn.Conn().Close(context.Background()) // search_path was changed: do not reuse
	run := func(name string) {
		b, err := fs.ReadFile(pgstore.Migrations, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx30(t), string(b)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if _, err := conn.Exec(ctx30(t), "SET search_path TO "+pgx.Identifier{db.schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	run("001_create.up.sql")
	run("001_create.up.sql") // idempotent
	run("002_create_steps.up.sql")
	run("002_create_steps.up.sql")
	run("003_steps_fingerprint.up.sql")
	run("003_steps_fingerprint.up.sql")
	if n := db.count(t, `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'idem_records_steps' AND column_name = 'fingerprint'`, db.schema); n != 1 {
		t.Fatalf("up migrations made %d fingerprint columns", n)
	}
	run("003_steps_fingerprint.down.sql")
	if n := db.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idem_records_steps'`, db.schema); n != 1 {
		t.Fatalf("up migration made %d idem_records_steps tables", n)
	}
	run("002_create_steps.down.sql")
	if n := db.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idem_records'`, db.schema); n != 1 {
		t.Fatalf("up migration made %d idem_records tables", n)
	}
	run("001_create.down.sql")
	if n := db.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, db.schema); n != 0 {
		t.Fatalf("down migration left %d tables", n)
	}
}

func TestMissingTableSaysMigrate(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s, err := pgstore.New(db.pool, &pgstore.Config{Table: db.table("never_made")})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Get(ctx30(t), "s", "k", time.Now())
	if err == nil || !strings.Contains(err.Error(), "Migrate") {
		t.Fatalf("Get on a missing table = %v, want an error that says to run Migrate", err)
	}
}

// TestReplayTakesNoLock: a claim that finds a complete record answers without
// writing or locking the row, so a replay is not held up by a lock on it.
func TestReplayTakesNoLock(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	now := time.Now()
	req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:a", Token: "t1", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	if _, claimed, err := s.Claim(ctx30(t), req); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	if err := s.Complete(ctx30(t), "s", "k", "t1", &idem.Response{Status: 201, Body: []byte("done")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	locker, err := db.pool.Begin(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback(context.Background())
	if _, err := locker.Exec(ctx30(t), `SELECT 1 FROM `+s.Table()+` FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req.Token, req.Now = "t2", now.Add(time.Second)
	rec, claimed, err := s.Claim(ctx, req)
	if err != nil || claimed || rec.State != idem.StateComplete || string(rec.Response.Body) != "done" {
		t.Fatalf("Claim of a complete, row-locked record = %+v, %v, %v; want the complete record at once", rec, claimed, err)
	}
}

func TestHeaderBytesRoundTrip(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s := db.newStore(t)
	now := time.Now()
	h := http.Header{"Content-Disposition": {"attachment; filename=\"caf\xe9.txt\"", "nul\x00byte", "plain", ""}, "Link": {"<\u00fc>"}, "X-Escaped": {"q\"b\\s\x01\x1f\t\r\n\u2028\U0001f600"}}
	req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:\xff\x00raw", Token: "t1", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	if _, claimed, err := s.Claim(ctx30(t), req); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	if err := s.Complete(ctx30(t), "s", "k", "t1", &idem.Response{Status: 200, Header: h}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx30(t), "s", "k", now)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Fingerprint != req.Fingerprint {
		t.Errorf("Fingerprint = %q, want %q", rec.Fingerprint, req.Fingerprint)
	}
	for k, want := range h {
		if got := rec.Response.Header[k]; strings.Join(got, "|") != strings.Join(want, "|") || len(got) != len(want) {
			t.Errorf("Header[%q] = %q, want %q", k, got, want)
		}
	}
}

func TestSingleTxStore(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 6)
	s := db.newStore(t)
	now := time.Now()

	ctx, tx, rec, err := s.BeginLocked(ctx30(t), "s", "k", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked of an absent key = %+v, %v", rec, err)
	}
	if pgstore.Tx(ctx) == nil || pgstore.Tx(context.Background()) != nil {
		t.Fatal("Tx(ctx) must return the transaction inside BeginLocked's context and nil outside")
	}
	if _, _, _, err := s.BeginLocked(ctx30(t), "s", "k", now); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("second BeginLocked while the first holds the lock = %v, want ErrInFlight", err)
	}
	if _, tx2, _, err := s.BeginLocked(ctx30(t), "s", "other", now); err != nil {
		t.Fatalf("BeginLocked of another key: %v", err)
	} else {
		_ = tx2.Rollback(ctx30(t))
	}
	complete := &idem.Record{Scope: "s", Key: "k", State: idem.StateComplete, Fingerprint: "v1:a", Token: "t",
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201, Body: []byte("one")}}
	if err := tx.Insert(ctx30(t), complete); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx30(t), "s", "k", now); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("the uncommitted record is visible: %v", err)
	}
	if err := tx.Commit(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx30(t)); err != nil {
		t.Fatalf("Rollback after Commit = %v, want nil", err)
	}

	// The committed record is found (live), and counts as absent once expired.
	_, tx, rec, err = s.BeginLocked(ctx30(t), "s", "k", now.Add(time.Minute))
	if err != nil || rec == nil || rec.State != idem.StateComplete || string(rec.Response.Body) != "one" {
		t.Fatalf("BeginLocked of a complete key = %+v, %v", rec, err)
	}
	// Concurrent retries of a complete key replay side by side: a reader holds
	// no lock that would turn the next one away.
	_, tx2, rec2, err := s.BeginLocked(ctx30(t), "s", "k", now.Add(time.Minute))
	if err != nil || rec2 == nil || rec2.State != idem.StateComplete {
		t.Fatalf("BeginLocked of a complete key while another reader is open = %+v, %v; want the record", rec2, err)
	}
	_ = tx2.Rollback(ctx30(t))
	_ = tx.Rollback(ctx30(t))
	later := now.Add(2 * time.Hour)
	_, tx, rec, err = s.BeginLocked(ctx30(t), "s", "k", later)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked of an expired key = %+v, %v; want nil record", rec, err)
	}
	again := *complete
	again.CreatedAt, again.ExpiresAt, again.Response = later, later.Add(time.Hour), &idem.Response{Status: 201, Body: []byte("two")}
	if err := tx.Insert(ctx30(t), &again); err != nil {
		t.Fatalf("Insert over an expired record: %v", err)
	}
	if err := tx.Commit(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get(ctx30(t), "s", "k", later); err != nil || string(got.Response.Body) != "two" || !got.CreatedAt.After(now.Add(time.Hour)) {
		t.Fatalf("after replacing the expired record: %+v, %v", got, err)
	}

	// A claim-then-complete request holds another key: Insert reports ErrInFlight.
	_, tx, _, err = s.BeginLocked(ctx30(t), "s", "claimed", now)
	if err != nil {
		t.Fatal(err)
	}
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "claimed", Fingerprint: "v1:a", Token: "c", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	blocked := *complete
	blocked.Key = "claimed"
	// The insert travels with COMMIT, so Commit is where ErrInFlight shows.
	if err := tx.Insert(ctx30(t), &blocked); err != nil {
		_ = tx.Rollback(ctx30(t))
		t.Fatalf("Insert: %v", err)
	}
	err = tx.Commit(ctx30(t))
	_ = tx.Rollback(ctx30(t))
	if !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("Commit of an insert over a live in-flight claim = %v, want ErrInFlight", err)
	}
	if got, err := s.Get(ctx30(t), "s", "claimed", now); err != nil || got.State != idem.StateInFlight || got.Token != "c" {
		t.Fatalf("the in-flight claim was changed: %+v, %v", got, err)
	}
	for deadline := time.Now().Add(5 * time.Second); db.pool.Stat().AcquiredConns() != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) { // the pool releases in the background
			t.Fatalf("%d connections still acquired after every transaction ended", db.pool.Stat().AcquiredConns())
		}
	}
}

func TestTxStoreRollbackAfterCommit(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s := db.newStore(t)
	ctx, tx, err := s.BeginTx(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	if pgstore.Tx(ctx) == nil {
		t.Fatal("Tx(ctx) is nil inside BeginTx's context")
	}
	// The fenced completion travels with COMMIT: a completion of an absent record
	// turns the commit into ErrLockLost, and Rollback then ends the transaction.
	if err := tx.Complete(ctx30(t), "s", "absent", "t", &idem.Response{Status: 200}, time.Now(), time.Now().Add(time.Hour)); err != nil {
		t.Fatalf("Tx.Complete: %v", err)
	}
	err = tx.Commit(ctx30(t))
	if rerr := tx.Rollback(ctx30(t)); rerr != nil {
		t.Fatalf("Rollback after a fenced-out Commit = %v, want nil", rerr)
	}
	if !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Commit with the completion of an absent record = %v, want ErrLockLost", err)
	}

	// A completion that matches commits with the business write.
	now := time.Now()
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:f", Token: "t",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	ctx, tx, err = s.BeginTx(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pgstore.Tx(ctx).Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx30(t), "s", "k", "t", &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(time.Hour)); err != nil {
		t.Fatalf("Tx.Complete: %v", err)
	}
	if err := tx.Commit(ctx30(t)); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	if err := tx.Rollback(ctx30(t)); err != nil {
		t.Fatalf("Rollback after Commit = %v, want nil", err)
	}
	if rec, err := s.Get(ctx30(t), "s", "k", now); err != nil || rec.State != idem.StateComplete || string(rec.Response.Body) != "ok" {
		t.Fatalf("after Commit: %+v, %v; want the completed record", rec, err)
	}
	if n := db.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired after Commit", n)
	}
}
