package main

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
)

// The MySQL/MariaDB example, against the real server: 20 requests with one key
// released at once make one order, every 201 is the same answer, the others are
// 409; a later retry is the replay; the order and its record committed together.
func TestMySQLExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := freshDatabase(t, ctx, testenv.MySQLURL(t))
	h, err := newServer(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	created := exampletest.Burst(t, srv.URL+"/orders", "my-key-1", 20)
	status, replayed, body := exampletest.Post(t, srv.URL+"/orders", "my-key-1")
	if status != http.StatusCreated || replayed != "true" || body != created {
		t.Fatalf("retry after the burst: %d %q (Idempotent-Replayed %q); want the replay of %q", status, body, replayed, created)
	}
	var orders, records int
	if err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM example_orders WHERE cart_id = 'c_42'), (SELECT count(*) FROM idem_records)`).Scan(&orders, &records); err != nil {
		t.Fatal(err)
	}
	if orders != 1 || records != 1 {
		t.Fatalf("%d orders, %d key records after 21 requests with one key; want 1 and 1", orders, records)
	}
}

// freshDatabase creates a database of the test's own on the server of raw (a
// mysql:// URL), dropped when the test ends, so that the example's tables do not
// meet other tests', and returns a *sql.DB connected to it.
func freshDatabase(t *testing.T, ctx context.Context, raw string) *sql.DB {
	t.Helper()
	admin, err := sql.Open("mysql", testenv.MySQLDSN(raw))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	name := "example_my_" + exampletest.RandomHex(t)
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("CREATE DATABASE on %s: %v", raw, err)
	}
	t.Cleanup(func() { _, _ = admin.ExecContext(context.Background(), "DROP DATABASE "+name) })
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	db, err := sql.Open("mysql", testenv.MySQLDSN(u.String()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// The example runs the janitor: a key record that expired is deleted in the
// background (no example ran idem.Janitor, so a library user's table grew).
func TestMySQLExampleJanitor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := freshDatabase(t, ctx, testenv.MySQLURL(t))
	janitorEvery = 10 * time.Millisecond
	defer func() { janitorEvery = time.Minute }()
	if _, err := newServer(ctx, db); err != nil {
		t.Fatal(err)
	}
	store, err := mysqlstore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	now := time.Now()
	if _, ok, err := store.Claim(ctx, idem.ClaimRequest{Key: "old", Fingerprint: "v2:x", Token: "t", Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-2 * time.Hour).Add(time.Minute), ExpiresAt: now.Add(-time.Hour)}); err != nil || !ok {
		t.Fatalf("claim an expired record: %v %v", ok, err)
	}
	exampletest.WaitGone(t, "the expired key record", func() (bool, error) {
		var n int
		err := db.QueryRowContext(ctx, "SELECT count(*) FROM idem_records WHERE `key` = 'old'").Scan(&n)
		return n == 0, err
	})
}

// -dsn takes the mysql:// URL idem's CLI takes as well as the driver's DSN.
func TestMySQLExampleDSNForms(t *testing.T) {
	for in, want := range map[string]string{
		"root@tcp(127.0.0.1:3306)/test":                    "root@tcp(127.0.0.1:3306)/test",
		"mysql://root@127.0.0.1:3306/test":                 "root@tcp(127.0.0.1:3306)/test",
		"mysql://u:p%40ss@db/app?timeout=5s&tls=preferred": "u:p@ss@tcp(db:3306)/app?timeout=5s&tls=preferred",
	} {
		got, err := mysqlDSN(in)
		if err != nil || got != want {
			t.Errorf("mysqlDSN(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := mysqlDSN("mysql://root@127.0.0.1:3306/test?parseTime=maybe"); err == nil {
		t.Error("a bad driver option was accepted")
	}
	// The URL form of the test server reaches it.
	dsn, err := mysqlDSN(testenv.MySQLURL(t))
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Ping(); err != nil {
		t.Fatalf("-dsn %s (DSN %s): %v", testenv.MySQLURL(t), dsn, err)
	}
}
