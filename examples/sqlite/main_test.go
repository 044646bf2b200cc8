package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// The SQLite example commits one order for two requests with one key, and
// replays the first answer.
func TestSQLiteExample(t *testing.T) {
	db, err := embedded.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	h, err := newServer(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	var bodies []string
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_42"}`))
		req.Header.Set("Idempotency-Key", "k-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		bodies = append(bodies, string(b))
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 || bodies[0] != `{"id":1}` || bodies[1] != bodies[0] {
		t.Fatalf("%d orders, answers %q; want one order, replayed", n, bodies)
	}
}

// The example runs the janitor: a key record that expired is deleted in the
// background, without `idem gc` (no example ran idem.Janitor, so a library
// user's table grew unless they found it).
func TestSQLiteExampleJanitor(t *testing.T) {
	db, err := embedded.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	janitorEvery = 10 * time.Millisecond
	defer func() { janitorEvery = time.Minute }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := newServer(ctx, db); err != nil {
		t.Fatal(err)
	}
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, ok, err := store.Claim(ctx, idem.ClaimRequest{Scope: "", Key: "old", Fingerprint: "v2:x", Token: "t", Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-2 * time.Hour).Add(time.Minute), ExpiresAt: now.Add(-time.Hour)}); err != nil || !ok {
		t.Fatalf("claim an expired record: %v %v", ok, err)
	}
	exampletest.WaitGone(t, "the expired key record", func() (bool, error) {
		var n int
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_records WHERE key = 'old'`).Scan(&n)
		return n == 0, err
	})
}

// The command honours -addr and -db, as the README says the examples do: it
// listened on 127.0.0.1:8080 and wrote app.db whatever it was given.
func TestSQLiteExampleFlags(t *testing.T) {
	path := filepath.Join(t.TempDir(), "flags.db")
	url := exampletest.RunMain(t, "-addr", "127.0.0.1:0", "-db", path)
	if strings.HasSuffix(url, ":8080") {
		t.Fatalf("asked for a free port, listening on %s", url)
	}
	if status, _, body := exampletest.Post(t, url+"/orders", "sq-addr-1"); status != http.StatusCreated {
		t.Fatalf("POST %s/orders: %d %s", url, status, body)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("-db %s: %v", path, err)
	}
}
