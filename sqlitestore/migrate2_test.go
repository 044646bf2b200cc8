package sqlitestore_test

import (
	"context"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// A database of the first schema (a rowid table with an expires_at index)
// migrates to the clustered table: every record is kept as it was, complete
// records replay byte for byte, an in-flight claim can still complete with its
// token, and expired ones are still deleted by the janitor.
func TestMigrateFromRowidTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "old.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	// The schema as version 1 left it, applied the way Migrate applied it.
	v1, err := fs.ReadFile(sqlitestore.Migrations, "001_create_records.up.sql")
	if err != nil {
		t.Fatal(err)
	}
	ddl := strings.NewReplacer("{{table}}", `"idem_records"`, "{{name}}", "idem_records").Replace(string(v1))
	for _, q := range []string{
		ddl,
		`CREATE TABLE idem_migrations (table_name TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL, applied_at INTEGER NOT NULL, PRIMARY KEY (table_name, version))`,
		`INSERT INTO idem_migrations VALUES ('idem_records', 1, '001_create_records.up.sql', 0)`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	createOrders(t, db)
	// Records written through the middleware into the old table (the store's
	// statements run on either shape).
	old, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mustMiddleware(t, old)(orderHandler(nil)))
	defer srv.Close()
	keys := []string{"order-1", "order-2", "order-3"}
	first := map[string]string{}
	for _, k := range keys {
		a := post(t, srv.URL, k, k)
		if a.status != http.StatusCreated {
			t.Fatalf("%s: %d %s", k, a.status, a.body)
		}
		first[k] = a.header.Get("Location") + " " + a.body
	}
	now := time.Now()
	rec, won, err := old.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "in-flight", Fingerprint: "f", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Hour), ExpiresAt: now.Add(time.Hour)})
	if err != nil || !won {
		t.Fatalf("claim: %v, %v", won, err)
	}
	if _, won, err := old.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "expired", Fingerprint: "f", Token: "tok",
		Now: now.Add(-time.Hour), LeaseUntil: now.Add(-time.Minute), ExpiresAt: now.Add(-time.Minute)}); err != nil || !won {
		t.Fatalf("claim: %v, %v", won, err)
	}
	srv.Close()
	_ = old.Close()
	var before string
	if err := db.QueryRow(`SELECT group_concat(scope || '|' || key || '|' || state || '|' || fingerprint || '|' || token || '|' || created_at || '|' || lease_until || '|' || expires_at || '|' || ifnull(status, '') || '|' || ifnull(headers, '') || '|' || hex(ifnull(body, '')) || '|' || body_omitted || '|' || ifnull(ref, ''), ';') FROM (SELECT * FROM idem_records ORDER BY scope, key)`).Scan(&before); err != nil {
		t.Fatal(err)
	}

	// Migrate, as a new version of the application (or `idem migrate`) does.
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var after, ddl2 string
	if err := db.QueryRow(`SELECT group_concat(scope || '|' || key || '|' || state || '|' || fingerprint || '|' || token || '|' || created_at || '|' || lease_until || '|' || expires_at || '|' || ifnull(status, '') || '|' || ifnull(headers, '') || '|' || hex(ifnull(body, '')) || '|' || body_omitted || '|' || ifnull(ref, ''), ';') FROM (SELECT * FROM idem_records ORDER BY scope, key)`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Errorf("records changed by the migration:\nbefore %s\nafter  %s", before, after)
	}
	if strings.Count(before, ";") != 4 {
		t.Errorf("want 5 records before the migration, have %s", before)
	}
	if err := db.QueryRow(`SELECT sql FROM sqlite_master WHERE name = 'idem_records'`).Scan(&ddl2); err != nil || !strings.Contains(ddl2, "WITHOUT ROWID") {
		t.Errorf("after the migration: %v\n%s", err, ddl2)
	}
	var idx int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'idem_records'`).Scan(&idx); err != nil || idx != 0 {
		t.Errorf("indexes after the migration: %d, %v; want none", idx, err)
	}

	srv2 := httptest.NewServer(mustMiddleware(t, s)(orderHandler(nil)))
	defer srv2.Close()
	for _, k := range keys {
		a := post(t, srv2.URL, k, k)
		if a.status != http.StatusCreated || a.header.Get("Idempotent-Replayed") != "true" || a.header.Get("Location")+" "+a.body != first[k] {
			t.Errorf("%s after the migration: %d replayed=%q %s %s; want the replay of %s", k, a.status,
				a.header.Get("Idempotent-Replayed"), a.header.Get("Location"), a.body, first[k])
		}
	}
	var orders int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&orders); err != nil || orders != len(keys) {
		t.Errorf("%d orders, %v; want %d (no replay executed)", orders, err, len(keys))
	}
	if err := s.Complete(ctx, "s", "in-flight", rec.Token, &idem.Response{Status: 200, Body: []byte("ok")}, now, now.Add(time.Hour)); err != nil {
		t.Errorf("completing the claim made before the migration: %v", err)
	}
	if n, err := s.DeleteExpired(ctx, time.Now(), 100); err != nil || n != 1 {
		t.Errorf("DeleteExpired after the migration: %d, %v; want the 1 expired record", n, err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Errorf("Migrate again: %v", err)
	}
}

func mustMiddleware(t *testing.T, s *sqlitestore.Store) func(http.Handler) http.Handler {
	t.Helper()
	mw, err := idem.New(s, nil)
	if err != nil {
		t.Fatal(err)
	}
	return mw
}
