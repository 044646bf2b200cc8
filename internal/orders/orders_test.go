package orders_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/memstore"
	_ "modernc.org/sqlite"
)

// openSQLite opens a fresh SQLite file database for one test.
func openSQLite(t *testing.T) *sql.DB {
	t.Helper()
	path := filepath.Join(t.TempDir(), "orders.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

type bundle struct {
	db  *sql.DB
	svc *orders.Service
	srv *httptest.Server
}

// setup serves the service over SQLite behind Authenticate and the idem
// middleware (memstore, so the handler commits its own transaction).
func setup(t *testing.T, cfg *orders.Config) *bundle {
	t.Helper()
	db := openSQLite(t)
	b, err := orders.SQL(db, orders.SQLite, nil)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := orders.New(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	store := memstore.New(nil)
	t.Cleanup(func() { store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(orders.Authenticate(svc.Handler(mw)))
	t.Cleanup(srv.Close)
	return &bundle{db: db, svc: svc, srv: srv}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func (b *bundle) do(t *testing.T, method, path, tenant, key, body string) answer {
	t.Helper()
	req, err := http.NewRequest(method, b.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if tenant != "" {
		req.Header.Set("Authorization", "Bearer "+tenant)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := b.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, data}
}

func (b *bundle) count(t *testing.T, tenant, cart string) int {
	t.Helper()
	var n int
	if err := b.db.QueryRow("SELECT count(*) FROM orders WHERE tenant = ? AND cart_id = ?", tenant, cart).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestCreateGetList(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	a := b.do(t, "POST", "/orders", "t1", "k1", `{"cart_id":"c_42","total_cents":1900}`)
	if a.status != 201 {
		t.Fatalf("POST: status %d, body %s", a.status, a.body)
	}
	var o orders.Order
	if err := json.Unmarshal(a.body, &o); err != nil {
		t.Fatal(err)
	}
	if o.CartID != "c_42" || o.TotalCents != 1900 || !strings.HasPrefix(o.ID, "ord_") || o.CreatedAt.IsZero() {
		t.Fatalf("order = %+v", o)
	}
	if loc := a.header.Get("Location"); loc != "/orders/"+o.ID {
		t.Fatalf("Location = %q, want /orders/%s", loc, o.ID)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type = %q", ct)
	}

	g := b.do(t, "GET", "/orders/"+o.ID, "t1", "", "")
	var got orders.Order
	if g.status != 200 || json.Unmarshal(g.body, &got) != nil || got != o {
		t.Fatalf("GET own order: %d %s, want %+v", g.status, g.body, o)
	}
	if g := b.do(t, "GET", "/orders/"+o.ID, "t2", "", ""); g.status != 404 || !strings.Contains(string(g.body), `"code":"order_not_found"`) {
		t.Fatalf("GET by another tenant: %d %s, want 404 order_not_found", g.status, g.body)
	}

	l := b.do(t, "GET", "/orders?cart_id=c_42", "t1", "", "")
	var list struct{ Orders []orders.Order }
	if l.status != 200 || json.Unmarshal(l.body, &list) != nil || len(list.Orders) != 1 || list.Orders[0] != o {
		t.Fatalf("list: %d %s", l.status, l.body)
	}
	if l := b.do(t, "GET", "/orders?cart_id=c_42", "t2", "", ""); string(l.body) != "{\"orders\":[]}\n" {
		t.Fatalf("list of another tenant: %d %q, want an empty list", l.status, l.body)
	}
	if l := b.do(t, "GET", "/orders", "t1", "", ""); l.status != 200 || !strings.Contains(string(l.body), o.ID) {
		t.Fatalf("list all: %d %s", l.status, l.body)
	}

	// The replay is byte-identical and nothing is inserted twice.
	r := b.do(t, "POST", "/orders", "t1", "k1", `{"cart_id":"c_42","total_cents":1900}`)
	if r.status != 201 || string(r.body) != string(a.body) || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s %v", r.status, r.body, r.header)
	}
	if n := b.count(t, "t1", "c_42"); n != 1 {
		t.Fatalf("%d orders for c_42, want 1", n)
	}
}

func TestValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cases := []struct{ body, want string }{
		{`{"cart_id":"c_1","total_cents":19`, "not a valid order"},
		{`not json`, "not a valid order"},
		{`{"total_cents":1900}`, "cart_id is missing"},
		{`{"cart_id":null,"total_cents":1900}`, "cart_id is missing"},
		{`{"cart_id":"","total_cents":1900}`, "cart_id is empty"},
		{`{"cart_id":42,"total_cents":1900}`, "cart_id must be a string"},
		{`{"cart_id":"` + strings.Repeat("x", 256) + `","total_cents":1}`, "cart_id is 256 bytes"},
		{`{"cart_id":"c_1"}`, "total_cents is missing"},
		{`{"cart_id":"c_1","total_cents":-1}`, "cannot be negative"},
		{`{"cart_id":"c_1","total_cents":19.5}`, "whole number"},
		{`{"cart_id":"c_1","total_cents":1900.0}`, "whole number"},
		{`{"cart_id":"c_1","total_cents":"1900"}`, "whole number"},
		{`{"cart_id":"c_1","total_cents":1e3}`, "whole number"},
		{`{"cart_id":"c_1","total_cents":1900,"coupon":"x"}`, "unknown field"},
		{`{"cart_id":"c_1","total_cents":1900} {}`, "data after"},
	}
	for i, c := range cases {
		key := fmt.Sprintf("v%d", i)
		a := b.do(t, "POST", "/orders", "t1", key, c.body)
		if a.status != 400 || a.header.Get("Content-Type") != "application/problem+json" ||
			!strings.Contains(string(a.body), `"code":"invalid_order"`) || !strings.Contains(string(a.body), c.want) {
			t.Errorf("body %s: %d %s %s, want 400 invalid_order mentioning %q", c.body, a.status, a.header.Get("Content-Type"), a.body, c.want)
			continue
		}
		// The handler wrote the 400, behind idem: it is stored and replayed.
		r := b.do(t, "POST", "/orders", "t1", key, c.body)
		if r.status != 400 || r.header.Get("Idempotent-Replayed") != "true" || string(r.body) != string(a.body) {
			t.Errorf("retry of %s: %d replayed=%q, want the stored 400", c.body, r.status, r.header.Get("Idempotent-Replayed"))
		}
	}
	var n int
	if err := b.db.QueryRow("SELECT count(*) FROM orders").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d orders after invalid requests (err %v), want 0", n, err)
	}
	if a := b.do(t, "POST", "/orders", "t1", "zero", `{"cart_id":"c_1","total_cents":0}`); a.status != 201 {
		t.Fatalf("total_cents 0: %d %s, want 201", a.status, a.body)
	}
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, auth := range []string{"", "Bearer", "Bearer ", "Basic dDE6", "bearer"} {
		req, _ := http.NewRequest("POST", b.srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_1","total_cents":1}`))
		req.Header.Set("Idempotency-Key", "auth-key")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := b.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 401 || !strings.Contains(string(body), `"code":"unauthorized"`) || resp.Header.Get("WWW-Authenticate") == "" {
			t.Fatalf("Authorization %q: %d %s, want 401 unauthorized", auth, resp.StatusCode, body)
		}
	}
	// The 401s were never bound to the key: an authorized request with it executes.
	if a := b.do(t, "POST", "/orders", "t1", "auth-key", `{"cart_id":"c_1","total_cents":1}`); a.status != 201 || a.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("authorized request after 401s: %d %s", a.status, a.body)
	}
}

func TestConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t, &orders.Config{HandlerDelay: 300 * time.Millisecond})
	const n = 10
	var wg sync.WaitGroup
	start := make(chan struct{})
	statuses := make([]int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", b.srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_race","total_cents":5}`))
			req.Header.Set("Authorization", "Bearer t1")
			req.Header.Set("Idempotency-Key", "race")
			// A fresh transport per request: each is sent exactly once.
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
			<-start
			resp, err := client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		}()
	}
	close(start)
	wg.Wait()
	created := 0
	for _, s := range statuses {
		switch s {
		case 201:
			created++
		case 409:
		default:
			t.Errorf("status %d, want 201 or 409", s)
		}
	}
	if created < 1 {
		t.Errorf("no 201 among %v", statuses)
	}
	if got := b.count(t, "t1", "c_race"); got != 1 {
		t.Fatalf("%d orders for the cart, want exactly 1 (statuses %v)", got, statuses)
	}
}

// TestStoreTransaction proves that the handler writes in the transaction txFunc
// hands it: rolling that transaction back leaves no order.
func TestStoreTransaction(t *testing.T) {
	t.Parallel()
	db := openSQLite(t)
	type txKey struct{}
	b, err := orders.SQL(db, orders.SQLite, func(ctx context.Context) *sql.Tx {
		tx, _ := ctx.Value(txKey{}).(*sql.Tx)
		return tx
	})
	if err != nil {
		t.Fatal(err)
	}
	if !b.Transactional() {
		t.Fatal("Transactional() = false with a txFunc")
	}
	svc, err := orders.New(b, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	h := svc.Handler(nil)
	for _, commit := range []bool{false, true} {
		tx, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_tx","total_cents":7}`))
		req = req.WithContext(context.WithValue(idem.WithScope(req.Context(), "t1"), txKey{}, tx))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != 201 {
			t.Fatalf("POST: %d %s", rec.Code, rec.Body)
		}
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
		list, err := svc.Orders(context.Background(), "t1", "c_tx")
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		if commit {
			want = 1
		}
		if len(list) != want {
			t.Fatalf("commit=%v: %d orders, want %d", commit, len(list), want)
		}
	}
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	db := openSQLite(t)
	if _, err := orders.SQL(db, orders.Postgres, nil); err == nil || !strings.Contains(err.Error(), "orders.Pgx") {
		t.Errorf("SQL with Postgres: %v", err)
	}
	if _, err := orders.SQL(nil, orders.SQLite, nil); err == nil {
		t.Error("SQL(nil): no error")
	}
	if _, err := orders.Pgx(nil, nil); err == nil {
		t.Error("Pgx(nil): no error")
	}
	b, _ := orders.SQL(db, orders.SQLite, nil)
	if _, err := orders.New(b, &orders.Config{Table: "orders; DROP TABLE x"}); err == nil || !strings.Contains(err.Error(), "identifier") {
		t.Errorf("bad table name: %v", err)
	}
	if _, err := orders.New(nil, nil); err == nil {
		t.Error("New(nil): no error")
	}
}

func TestHealthz(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if a := b.do(t, "GET", "/healthz", "t1", "", ""); a.status != 200 || string(a.body) != "{\"status\":\"ok\"}\n" {
		t.Fatalf("healthz: %d %s", a.status, a.body)
	}
	_ = b.db.Close()
	if a := b.do(t, "GET", "/healthz", "t1", "", ""); a.status != 503 {
		t.Fatalf("healthz with a closed database: %d %s, want 503", a.status, a.body)
	}
}

// TestOnCreate: OnCreate runs in the order's transaction: what it writes there
// commits with the order, and its error rolls both back (500).
func TestOnCreate(t *testing.T) {
	var fail bool
	b := setup(t, &orders.Config{OnCreate: func(ctx context.Context, tx orders.Tx, tenant string, o orders.Order) error {
		if tx.SQL == nil || tx.Pgx != nil {
			return fmt.Errorf("OnCreate got %+v, want the *sql.Tx", tx)
		}
		if _, err := tx.SQL.ExecContext(ctx, "INSERT INTO events (order_id, tenant) VALUES (?, ?)", o.ID, tenant); err != nil {
			return err
		}
		if fail {
			return fmt.Errorf("refused")
		}
		return nil
	}})
	if _, err := b.db.Exec("CREATE TABLE events (order_id TEXT NOT NULL, tenant TEXT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	a := b.do(t, "POST", "/orders", "t1", "k1", `{"cart_id":"c_ev","total_cents":5}`)
	if a.status != 201 {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	var o orders.Order
	if err := json.Unmarshal(a.body, &o); err != nil {
		t.Fatal(err)
	}
	var id, tenant string
	if err := b.db.QueryRow("SELECT order_id, tenant FROM events").Scan(&id, &tenant); err != nil || id != o.ID || tenant != "t1" {
		t.Fatalf("event row %q %q (%v); want %s t1", id, tenant, err, o.ID)
	}
	fail = true
	if a := b.do(t, "POST", "/orders", "t1", "k2", `{"cart_id":"c_ev","total_cents":5}`); a.status != 500 {
		t.Fatalf("POST with a failing OnCreate: %d %s; want 500", a.status, a.body)
	}
	var n int
	if err := b.db.QueryRow("SELECT count(*) FROM events").Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d event rows (%v) after the failed create; want 1 (rolled back)", n, err)
	}
	if n := b.count(t, "t1", "c_ev"); n != 1 {
		t.Fatalf("%d orders after the failed create; want 1 (rolled back)", n)
	}
}
