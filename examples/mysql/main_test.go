package main

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/internal/testenv"
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
