package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
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

	created := burst(t, srv.URL+"/orders", "pg-key-1", 20)
	status, replayed, body := post(t, srv.URL+"/orders", "pg-key-1")
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
	schema := "example_pg_" + randomHex(t)
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

// burst sends n identical requests with one key at the same moment and returns
// the body of the 201 they share; every other answer must be 409 in flight.
func burst(t *testing.T, url, key string, n int) string {
	t.Helper()
	type answer struct {
		status int
		body   string
	}
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i].status, _, answers[i].body = post(t, url, key)
		}()
	}
	close(start)
	wg.Wait()
	created := ""
	for _, a := range answers {
		switch {
		case a.status == http.StatusCreated && (created == "" || created == a.body):
			created = a.body
		case a.status == http.StatusConflict:
		default:
			t.Fatalf("answer %d %q in a burst with one key; want one 201 body (replayed or not) and 409s; all: %v", a.status, a.body, answers)
		}
	}
	if created == "" {
		t.Fatalf("no 201 among %d requests with one key: %v", n, answers)
	}
	return created
}

func post(t *testing.T, url, key string) (status int, replayed, body string) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"cart_id":"c_42"}`))
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

func randomHex(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
