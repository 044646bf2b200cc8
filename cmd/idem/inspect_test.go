package main

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestInspectInFlight inspects a key while its request sleeps in the handler.
func TestInspectInFlight(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--flow", "claim-complete", "--handler-delay", "4s")
	key := "flight-" + cliRandHex(4)
	done := make(chan httpAnswer, 1)
	go func() { done <- sendHTTP(t, "POST", d.URL+"/orders", "t1", key, `{"cart_id":"c_fl","total_cents":1}`) }()
	db := "sqlite:" + filepath.Join(dir, "idem-demo.db")
	var out string
	deadline := time.Now().Add(3 * time.Second)
	for {
		var code int
		code, out, _ = runIdem(t, dir, nil, "inspect", "--db", db, "--scope", "t1", key)
		if code == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, want := range []string{"state:       in_flight", "left (until", "a retry gets 409"} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect while in flight lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "status:") {
		t.Errorf("an in-flight record shows a stored status:\n%s", out)
	}
	if a := <-done; a.Status != 201 {
		t.Fatalf("POST: %d %s", a.Status, a.Body)
	}
}

func TestInspectUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if code, out, _ := runIdem(t, dir, nil, "inspect", "--help"); code != 0 || !strings.Contains(out, "Example:") || !strings.Contains(out, "--scope") {
		t.Fatalf("inspect --help: exit %d\n%s", code, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"inspect", "--db", "sqlite:x.db"}, "give exactly one KEY (got 0 arguments)"},
		{[]string{"inspect", "--db", "sqlite:x.db", "a", "b"}, "give exactly one KEY (got 2 arguments)"},
		{[]string{"inspect", "k"}, "--db is required"},
		{[]string{"inspect", "--db", "sqlite:x.db", "bad key"}, "invalid idempotency key"},
		{[]string{"inspect", "--db", "mysql://root@127.0.0.1", "k"}, "name the server and the database"},
	} {
		if code, _, stderr := runIdem(t, dir, nil, c.args...); code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, stderr, c.want)
		}
	}
}

// seedSummary writes, through the store's own API, 2 complete records, 1 in
// flight with a live lease, 2 in flight past their lease and 1 expired.
func seedSummary(t *testing.T, s idem.Store) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	claim := func(key string, at, lease, exp time.Time) {
		t.Helper()
		if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "t1", Key: key, Fingerprint: "v2:x", Token: "tok-" + key, Now: at, LeaseUntil: lease, ExpiresAt: exp}); err != nil || !ok {
			t.Fatalf("claim %s: %v %v", key, ok, err)
		}
	}
	for _, k := range []string{"done-1", "done-2"} {
		claim(k, now, now.Add(time.Minute), now.Add(time.Hour))
		if err := s.Complete(ctx, "t1", k, "tok-"+k, &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	claim("running", now, now.Add(time.Hour), now.Add(2*time.Hour))
	claim("crashed-old", now.Add(-10*time.Minute), now.Add(-9*time.Minute), now.Add(time.Hour))
	claim("crashed-new", now.Add(-3*time.Minute), now.Add(-2*time.Minute), now.Add(time.Hour))
	claim("expired", now.Add(-3*time.Hour), now.Add(-3*time.Hour).Add(time.Minute), now.Add(-time.Hour))
}

// sqlKeyStore is a way to open a migrated key store of one SQL database.
type sqlKeyStore struct {
	name string
	open func(t *testing.T) (db string, s idem.Store) // the --db URL and the store
}

// sqlKeyStores opens a migrated key store with the given table on each SQL
// database, dropped when the test ends.
func sqlKeyStores(table string) []sqlKeyStore {
	ctx := context.Background()
	return []sqlKeyStore{
		{"sqlite", func(t *testing.T) (string, idem.Store) {
			path := filepath.Join(t.TempDir(), "sum.db")
			return "sqlite:" + path, sqliteKeyStore(t, path, &sqlitestore.Config{Table: table})
		}},
		{"postgres", func(t *testing.T) (string, idem.Store) {
			url := testenv.PostgresURL(t)
			pool, err := pgxpool.New(ctx, url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = pool.Exec(ctx, "DROP TABLE IF EXISTS "+table)
				pool.Close()
			})
			s, err := pgstore.New(pool, &pgstore.Config{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			return url, s
		}},
		{"mysql", func(t *testing.T) (string, idem.Store) {
			url := testenv.MySQLURL(t)
			db, err := sql.Open("mysql", testenv.MySQLDSN(url))
			if err != nil {
				t.Fatal(err)
			}
			s, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_ = s.Close()
				_, _ = db.Exec("DROP TABLE IF EXISTS `" + table + "`, `" + table + "_migrations`")
				_ = db.Close()
			})
			if err := s.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			return url, s
		}},
	}
}

// TestInspectSummary seeds each SQL store and checks the counts, the oldest
// in-flight record and the list of records past their lease.
func TestInspectSummary(t *testing.T) {
	t.Parallel()
	table := "insp_" + cliRandHex(4)
	cases := sqlKeyStores(table)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db, s := c.open(t)
			seedSummary(t, s)
			code, out, stderr := runIdem(t, t.TempDir(), nil, "inspect", "--db", db, "--table", table, "--summary")
			if code != 0 {
				t.Fatalf("inspect --summary: exit %d\n%s\n%s", code, out, stderr)
			}
			for _, want := range []string{
				"complete:          2\n", "in flight:         3\n", "past their lease:  2 ", "expired:           1 ",
				"oldest in flight:  created 10m0", `key "crashed-old": lease lapsed 9m0`, `key "crashed-new": lease lapsed 2m0`,
			} {
				if !strings.Contains(out, want) {
					t.Errorf("inspect --summary lacks %q:\n%s", want, out)
				}
			}
			if strings.Index(out, "crashed-old") > strings.Index(out, "crashed-new") || strings.Contains(out, `"running"`) {
				t.Errorf("the records past their lease are not listed oldest first, or a live one is listed:\n%s", out)
			}
		})
	}
	dir := t.TempDir()
	if code, _, stderr := runIdem(t, dir, nil, "inspect", "--db", "sqlite:x.db", "--summary", "k"); code != 2 || !strings.Contains(stderr, "--summary takes no KEY") {
		t.Errorf("--summary with a key: exit %d, %q", code, stderr)
	}
}

// TestInspectMissingDatabase: inspect of a SQLite file that does not exist
// creates none and says how to create it, once; a missing table gets the
// advice to migrate once.
func TestInspectMissingDatabase(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, _, stderr := runIdem(t, dir, nil, "inspect", "--db", "sqlite:missing.db", "--scope", "t1", "k")
	if code != 1 || !strings.Contains(stderr, "the file missing.db does not exist") || strings.Count(stderr, "idem migrate") != 1 {
		t.Errorf("missing file: exit %d, stderr %q", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "missing.db")); !os.IsNotExist(err) {
		t.Errorf("inspect created the SQLite file (stat: %v)", err)
	}
	if code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:app.db"); code != 0 {
		t.Fatalf("migrate: exit %d %s%s", code, out, stderr)
	}
	code, _, stderr = runIdem(t, dir, nil, "inspect", "--db", "sqlite:app.db", "--table", "nosuch", "--scope", "t1", "k")
	if code != 1 || strings.Count(stderr, "idem migrate") != 1 {
		t.Errorf("missing table: exit %d; want 1 and the advice to migrate once:\n%s", code, stderr)
	}
}
