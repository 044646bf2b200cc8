package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemkit/idem/sqlitestore/embedded"
)

// sqliteTables lists the tables of a SQLite file.
func sqliteTables(t *testing.T, path string) []string {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		names = append(names, n)
	}
	return names
}

func TestMigrateSQLite(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "m.db")
	for i := range 2 { // the second run finds everything in place
		code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:"+path)
		if code != 0 || !strings.Contains(out, "key records: ready (table idem_records of sqlite:"+path+")") || !strings.Contains(out, "orders:      ready (table orders of sqlite:"+path+")") {
			t.Fatalf("run %d: exit %d\n%s%s", i+1, code, out, stderr)
		}
	}
	tables := strings.Join(sqliteTables(t, path), " ")
	if !strings.Contains(tables, "idem_records") || !strings.Contains(tables, "orders") {
		t.Fatalf("tables after migrate: %s", tables)
	}

	// --orders=false and a custom table, from the environment.
	path2 := filepath.Join(dir, "keys-only.db")
	code, out, stderr := runIdem(t, dir, []string{"IDEM_DB=sqlite:" + path2, "IDEM_TABLE=billing_keys"}, "migrate", "--orders=false")
	if code != 0 || strings.Contains(out, "orders:") || !strings.Contains(out, "billing_keys") {
		t.Fatalf("keys only: exit %d\n%s%s", code, out, stderr)
	}
	tables = strings.Join(sqliteTables(t, path2), " ")
	if !strings.Contains(tables, "billing_keys") || strings.Contains(tables, "orders") {
		t.Fatalf("tables after migrate --orders=false --table billing_keys: %s", tables)
	}
}

func TestMigratePostgres(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	code, out, stderr := runIdem(t, t.TempDir(), nil, "migrate", "--db", dbURL)
	if code != 0 || !strings.Contains(out, "key records: ready") {
		t.Fatalf("exit %d\n%s%s", code, out, stderr)
	}
	var n int
	err := pgConnect(t, dbURL).QueryRow(context.Background(),
		"SELECT count(*) FROM information_schema.tables WHERE table_name IN ('idem_records', 'orders')").Scan(&n)
	if err != nil || n != 2 {
		t.Fatalf("%d of the 2 tables exist (err %v)", n, err)
	}
}

func TestMigrateUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if code, out, _ := runIdem(t, dir, nil, "migrate", "--help"); code != 0 || !strings.Contains(out, "Example:") || !strings.Contains(out, "[IDEM_DB]") {
		t.Fatalf("migrate --help: exit %d\n%s", code, out)
	}
	if code, _, _ := runIdem(t, dir, nil, "help", "migrate"); code != 0 {
		t.Fatalf("idem help migrate: exit %d", code)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"migrate"}, "--db is required"},
		{[]string{"migrate", "--db", "oracle://x"}, `unknown scheme "oracle"`},
		{[]string{"migrate", "--db", "sqlite:x.db", "now"}, `unexpected argument "now"`},
		{[]string{"migrate", "--bogus"}, "unknown flag --bogus"},
	} {
		if code, _, stderr := runIdem(t, dir, nil, c.args...); code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, stderr, c.want)
		}
	}
	// A database that does not answer is a failure (1), and says what to check.
	code, _, stderr := runIdem(t, dir, nil, "migrate", "--db", "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
	if code != 1 || !strings.Contains(stderr, "PostgreSQL does not answer") {
		t.Errorf("unreachable database: exit %d, stderr %q", code, stderr)
	}
}
