package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The PostgreSQL example, against the real server: 20 requests with one key
// released at once make one order, every 201 is the same answer, the others are
// 409; a later retry is the replay; the order and its record committed together.
func TestPostgresExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := schemaPool(t, ctx, testenv.PostgresURL(t))
	h, err := newServer(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	created := exampletest.Burst(t, srv.URL+"/orders", "pg-key-1", 20)
	status, replayed, body := exampletest.Post(t, srv.URL+"/orders", "pg-key-1")
	if status != http.StatusCreated || replayed != "true" || body != created {
		t.Fatalf("retry after the burst: %d %q (Idempotent-Replayed %q); want the replay of %q", status, body, replayed, created)
	}
	var orders, records int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM example_orders WHERE cart_id = 'c_42'), (SELECT count(*) FROM idem_records)`).Scan(&orders, &records); err != nil {
		t.Fatal(err)
	}
	if orders != 1 || records != 1 {
		t.Fatalf("%d orders, %d key records after 21 requests with one key; want 1 and 1", orders, records)
	}
}

// schemaPool returns a pool whose connections work in a fresh schema of their
// own (search_path), dropped when the test ends, so that the example's
// unqualified tables do not meet other tests'.
func schemaPool(t *testing.T, ctx context.Context, url string) *pgxpool.Pool {
	t.Helper()
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	schema := "example_pg_" + exampletest.RandomHex(t)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close(context.Background())
	})
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// The example runs the janitor: a key record that expired is deleted in the
// background (no example ran idem.Janitor, so a library user's table grew).
func TestPostgresExampleJanitor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := schemaPool(t, ctx, testenv.PostgresURL(t))
	janitorEvery = 10 * time.Millisecond
	defer func() { janitorEvery = time.Minute }()
	if _, err := newServer(ctx, pool); err != nil {
		t.Fatal(err)
	}
	store, err := pgstore.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, ok, err := store.Claim(ctx, idem.ClaimRequest{Key: "old", Fingerprint: "v2:x", Token: "t", Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-2 * time.Hour).Add(time.Minute), ExpiresAt: now.Add(-time.Hour)}); err != nil || !ok {
		t.Fatalf("claim an expired record: %v %v", ok, err)
	}
	exampletest.WaitGone(t, "the expired key record", func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_records WHERE key = 'old'::bytea`).Scan(&n)
		return n == 0, err
	})
}
