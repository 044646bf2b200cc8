package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

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

	created := burst(t, srv.URL+"/orders", "my-key-1", 20)
	status, replayed, body := post(t, srv.URL+"/orders", "my-key-1")
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
	name := "example_my_" + randomHex(t)
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
