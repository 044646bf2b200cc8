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
		code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:"+path, "--with-demo-orders")
		if code != 0 || !strings.Contains(out, "key records: ready (table idem_records of sqlite:"+path+")") || !strings.Contains(out, "orders:      ready (table orders of sqlite:"+path+")") {
			t.Fatalf("run %d: exit %d\n%s%s", i+1, code, out, stderr)
		}
	}
	tables := strings.Join(sqliteTables(t, path), " ")
	if !strings.Contains(tables, "idem_records") || !strings.Contains(tables, "orders") {
		t.Fatalf("tables after migrate: %s", tables)
	}

	// The default creates the key records' table only; a custom table, from
	// the environment. The old --orders=false stays accepted.
	for _, args := range [][]string{{"migrate"}, {"migrate", "--orders=false"}} {
		path2 := filepath.Join(dir, "keys-only-"+cliRandHex(4)+".db")
		code, out, stderr := runIdem(t, dir, []string{"IDEM_DB=sqlite:" + path2, "IDEM_TABLE=billing_keys"}, args...)
		if code != 0 || strings.Contains(out, "orders:") || !strings.Contains(out, "billing_keys") {
			t.Fatalf("%v: exit %d\n%s%s", args, code, out, stderr)
		}
		tables = strings.Join(sqliteTables(t, path2), " ")
		if !strings.Contains(tables, "billing_keys") || strings.Contains(tables, "orders") {
			t.Fatalf("tables after %v --table billing_keys: %s", args, tables)
		}
	}
}

func TestMigratePostgres(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	count := func() int {
		var n int
		err := pgConnect(t, dbURL).QueryRow(context.Background(),
			"SELECT count(*) FROM information_schema.tables WHERE table_name IN ('idem_records', 'orders')").Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	code, out, stderr := runIdem(t, t.TempDir(), nil, "migrate", "--db", dbURL)
	if code != 0 || !strings.Contains(out, "key records: ready") || !strings.Contains(out, `step records: ready (table "idem_records_steps")`) || strings.Contains(out, "orders:") {
		t.Fatalf("exit %d\n%s%s", code, out, stderr)
	}
	if n := count(); n != 1 {
		t.Fatalf("after idem migrate, %d of idem_records and orders exist; want idem_records alone", n)
	}
	var steps int
	if err := pgConnect(t, dbURL).QueryRow(context.Background(),
		"SELECT count(*) FROM information_schema.tables WHERE table_name = 'idem_records_steps'").Scan(&steps); err != nil || steps != 1 {
		t.Fatalf("after idem migrate, %d step records' tables (%v), want 1", steps, err)
	}
	code, out, stderr = runIdem(t, t.TempDir(), nil, "migrate", "--db", dbURL, "--with-demo-orders")
	if code != 0 || !strings.Contains(out, "orders:      ready") {
		t.Fatalf("--with-demo-orders: exit %d\n%s%s", code, out, stderr)
	}
	if n := count(); n != 2 {
		t.Fatalf("after --with-demo-orders, %d of the 2 tables exist", n)
	}
}

// TestMigrateLeavesUsersOrders is the deploy of a service that has an orders
// table of its own (other columns than the demo's): idem migrate creates the key
// records and succeeds, and the user's table is untouched.
func TestMigrateLeavesUsersOrders(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	conn := pgConnect(t, dbURL)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `CREATE TABLE orders (order_no bigint PRIMARY KEY, customer text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO orders VALUES (1, 'ada')`); err != nil {
		t.Fatal(err)
	}
	code, out, stderr := runIdem(t, t.TempDir(), nil, "migrate", "--db", dbURL)
	if code != 0 || !strings.Contains(out, "key records: ready") {
		t.Fatalf("idem migrate in a database with its own orders table: exit %d\n%s%s", code, out, stderr)
	}
	var cols []string
	rows, err := conn.Query(ctx, `SELECT column_name FROM information_schema.columns WHERE table_name = 'orders' ORDER BY ordinal_position`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			t.Fatal(err)
		}
		cols = append(cols, c)
	}
	rows.Close()
	var customer string
	if err := conn.QueryRow(ctx, `SELECT customer FROM orders WHERE order_no = 1`).Scan(&customer); err != nil || customer != "ada" {
		t.Fatalf("the user's order: %q, %v", customer, err)
	}
	if got := strings.Join(cols, ","); got != "order_no,customer" {
		t.Fatalf("the user's orders table now has columns %s", got)
	}
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_name = 'idem_records'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("idem_records: %d tables, %v", n, err)
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
