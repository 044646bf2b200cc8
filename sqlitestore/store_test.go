package sqlitestore_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/storetest"
)

// The store implements both contracts.
var (
	_ idem.Store   = (*sqlitestore.Store)(nil)
	_ idem.TxStore = (*sqlitestore.Store)(nil)
)

// openDB opens a fresh database file in t.TempDir() and closes it after the test.
func openDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "idem.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// newStore makes a migrated store on db, in a table of its own.
func newStore(t testing.TB, db *sql.DB) *sqlitestore.Store {
	t.Helper()
	s, err := sqlitestore.New(db, &sqlitestore.Config{Table: "idem_" + randomHex(6)})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Every subtest on a database file of its own.
func TestConformance(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T) idem.Store { return newStore(t, openDB(t)) })
}

// Every subtest on one database file, each in a table of its own: the subtests'
// writes meet at the file's one write lock.
func TestConformanceSharedFile(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newStore(t, db) })
}

// Stores on separate *sql.DB handles of one file behave like separate processes:
// their writes meet at SQLite's lock under the busy timeout, not in the
// in-process queue. A claim race across them still has one winner.
func TestClaimRaceAcrossHandles(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	const handles, perHandle = 4, 16
	var stores []*sqlitestore.Store
	for range handles {
		db, err := embedded.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := sqlitestore.New(db, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		stores = append(stores, s)
	}
	now := time.Now()
	start := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	winners := 0
	var errs []error
	for i := range handles * perHandle {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:x", Token: randomHex(8),
				Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
			<-start
			_, claimed, err := stores[i%handles].Claim(context.Background(), req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			if claimed {
				winners++
			}
		}()
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("claims failed: %v", err)
	}
	if winners != 1 {
		t.Fatalf("%d claims won, want exactly 1", winners)
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	for _, table := range []string{"1abc", "a-b", "a b", `x"y`, "main.t", strings.Repeat("a", 64)} {
		if _, err := sqlitestore.New(db, &sqlitestore.Config{Table: table}); err == nil {
			t.Errorf("New accepted table %q", table)
		}
	}
	if _, err := sqlitestore.New(nil, nil); err == nil {
		t.Error("New accepted a nil db")
	}
	if _, err := sqlitestore.New(db, &sqlitestore.Config{LockTimeout: -1}); err == nil {
		t.Error("New accepted a negative LockTimeout")
	}
	cfg := &sqlitestore.Config{}
	s, err := sqlitestore.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.Table() != sqlitestore.DefaultTable || cfg.Table != "" {
		t.Errorf("Table() = %q, cfg.Table = %q; want the default, and the caller's struct untouched", s.Table(), cfg.Table)
	}
	// Before Migrate, the error says what to do.
	now := time.Now()
	_, _, err = s.Claim(context.Background(), idem.ClaimRequest{Key: "k", Token: "t", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err == nil || !strings.Contains(err.Error(), "Migrate") {
		t.Errorf("Claim before Migrate: %v; want an error that says to run Migrate", err)
	}
	// A keyword is a valid table name: it is quoted.
	kw, err := sqlitestore.New(db, &sqlitestore.Config{Table: "order"})
	if err != nil {
		t.Fatal(err)
	}
	if err := kw.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate with table %q: %v", "order", err)
	}
}

// Migrate is idempotent, records its version, and concurrent runs (several
// processes starting at once) agree.
func TestMigrate(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			db, err := embedded.Open(path) // a handle each, like separate processes
			if err != nil {
				errs[i] = err
				return
			}
			defer db.Close()
			s, err := sqlitestore.New(db, nil)
			if err != nil {
				errs[i] = err
				return
			}
			errs[i] = s.Migrate(context.Background())
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	s, _ := sqlitestore.New(db, nil)
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM idem_migrations WHERE table_name = 'idem_records' AND version = 1`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("version 1 recorded %d times, want once", n)
	}
	if err := db.QueryRow(`SELECT count(*) FROM idem_migrations WHERE table_name = 'idem_records'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Errorf("%d versions recorded, want 2", n)
	}
}

// The records table is clustered on (scope, key), WITHOUT ROWID, with no
// other index: a first-time request writes one B-tree, and the janitor's
// statements walk the primary key (no full scan under the write lock).
func TestRecordsTableClustered(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := newStore(t, db)
	var ddl string
	if err := db.QueryRow(`SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?`, s.Table()).Scan(&ddl); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(ddl, "WITHOUT ROWID") {
		t.Errorf("records table is not WITHOUT ROWID:\n%s", ddl)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = ?`, s.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 { // a WITHOUT ROWID table's primary key is the table itself
		t.Errorf("records table has %d indexes, want none besides the table itself", n)
	}
	for _, q := range []string{
		`DELETE FROM "` + s.Table() + `" WHERE (scope, key) IN (SELECT scope, key FROM "` + s.Table() + `" WHERE (scope, key) > ('a', 'b') AND (scope, key) <= ('c', 'd') AND expires_at <= 1 ORDER BY scope, key LIMIT 5)`,
		`SELECT scope, key FROM "` + s.Table() + `" WHERE (scope, key) > ('a', 'b') AND expires_at <= 1 ORDER BY scope, key LIMIT 5`,
	} {
		if p := queryPlan(t, db, q); !strings.Contains(p, "SEARCH") || strings.Contains(p, "TEMP B-TREE") {
			t.Errorf("plan of %s\n= %q, want a range search of the primary key in its order", q, p)
		}
	}
}

func queryPlan(t *testing.T, db *sql.DB, q string) string {
	t.Helper()
	rows, err := db.Query(`EXPLAIN QUERY PLAN ` + q)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, notused int
		var detail string
		if err := rows.Scan(&id, &parent, &notused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	return strings.Join(plan, "; ")
}

// DeleteExpired resumes where its last call stopped and wraps around: batches
// of a sweep delete every expired record once, and never a live one, whatever
// the order of the keys.
func TestDeleteExpiredSweeps(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := newStore(t, db)
	ctx := context.Background()
	now := time.Now()
	live, expired := 0, 0
	for i := range 500 {
		exp := now.Add(time.Hour)
		if i%3 != 0 {
			exp = now.Add(-time.Minute)
			expired++
		} else {
			live++
		}
		_, won, err := s.Claim(ctx, idem.ClaimRequest{
			Scope: fmt.Sprintf("s%d", i%7), Key: fmt.Sprintf("k%03d", (i*37)%500), Fingerprint: "f", Token: "t",
			Now: now.Add(-2 * time.Hour), LeaseUntil: exp, ExpiresAt: exp,
		})
		if err != nil || !won {
			t.Fatalf("claim %d: won %v, %v", i, won, err)
		}
	}
	// A first batch stops mid-table; then new expired records appear before
	// the cursor: the next calls must find them too.
	n, err := s.DeleteExpired(ctx, now, 50)
	if err != nil || n != 50 {
		t.Fatalf("first batch: %d, %v; want 50", n, err)
	}
	for i := range 10 {
		_, won, err := s.Claim(ctx, idem.ClaimRequest{Scope: "a", Key: fmt.Sprintf("early%d", i), Fingerprint: "f", Token: "t",
			Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-time.Minute), ExpiresAt: now.Add(-time.Minute)})
		if err != nil || !won {
			t.Fatalf("claim early%d: won %v, %v", i, won, err)
		}
		expired++
	}
	total := n
	for range 100 {
		n, err := s.DeleteExpired(ctx, now, 7)
		if err != nil {
			t.Fatal(err)
		}
		if n > 7 {
			t.Fatalf("DeleteExpired(limit 7) deleted %d", n)
		}
		total += n
		if n < 7 {
			break
		}
	}
	if total != expired {
		t.Errorf("the sweep deleted %d records, want the %d expired ones", total, expired)
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM "` + s.Table() + `"`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != live {
		t.Errorf("%d records left, want the %d live ones", left, live)
	}
	if n, err := s.DeleteExpired(ctx, now, 7); err != nil || n != 0 {
		t.Errorf("DeleteExpired after the sweep: %d, %v; want 0", n, err)
	}
}
