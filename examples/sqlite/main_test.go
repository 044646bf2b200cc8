package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

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
