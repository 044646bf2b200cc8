package sqlitestore_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// The business table of the tests: orders, in the same database as the records.
const ordersSchema = `CREATE TABLE IF NOT EXISTS orders (
    id   INTEGER PRIMARY KEY,
    item TEXT NOT NULL
)`

func createOrders(t testing.TB, db *sql.DB) {
	t.Helper()
	if _, err := db.Exec(ordersSchema); err != nil {
		t.Fatal(err)
	}
}

func countOrders(t testing.TB, db *sql.DB) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// orderHandler inserts one order through the transaction idem opened, calls
// inside (when set) while the transaction is still open, and answers 201 with
// the order.
func orderHandler(inside func(ctx context.Context)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := sqlitestore.Tx(ctx)
		if tx == nil {
			http.Error(w, "no idem transaction in the request context", http.StatusInternalServerError)
			return
		}
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (item) VALUES (?)`, in.Item)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		if inside != nil {
			inside(ctx)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q}`, id, in.Item)
	})
}

// bareOrderHandler is orderHandler without idem: it opens and commits its own
// transaction (the baseline of the benchmarks).
func bareOrderHandler(db *sql.DB) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer func() { _ = tx.Rollback() }()
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (item) VALUES (?)`, in.Item)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		if err := tx.Commit(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q}`, id, in.Item)
	})
}

// serve wraps h in idem over store and serves it on loopback.
func serve(t testing.TB, store idem.Store, cfg *idem.Config, h http.Handler) *httptest.Server {
	t.Helper()
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv
}

type answer struct {
	status int
	header http.Header
	body   string
}

// post sends one order on a fresh connection (never re-sent by the Transport).
func post(t testing.TB, url, key, item string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"item":"`+item+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

func problemCode(body string) string {
	var p idem.Problem
	_ = json.Unmarshal([]byte(body), &p)
	return p.Code
}
