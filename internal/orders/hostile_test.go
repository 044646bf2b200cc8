package orders_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/memstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// served is the service on one dialect, behind Authenticate and the idem
// middleware (memstore), on a real loopback server.
type served struct {
	url   string
	svc   *orders.Service
	table string
	// exec runs a statement on the business database directly ('?' placeholders;
	// PostgreSQL statements are written with $n by the caller).
	exec func(t *testing.T, q string, args ...any)
}

// serveDialect serves the service over the named dialect ("sqlite", "postgres",
// "mysql") in a table of its own, with cfg (Table is set here).
func serveDialect(t *testing.T, dialect string, cfg orders.Config) *served {
	t.Helper()
	ctx := context.Background()
	s := &served{table: randomTable(t)}
	var b orders.Backend
	var err error
	switch dialect {
	case "sqlite":
		db := openSQLite(t)
		b, err = orders.SQL(db, orders.SQLite, nil)
		s.exec = sqlExec(db)
	case "postgres":
		pool, perr := pgxpool.New(ctx, testenv.PostgresURL(t))
		if perr != nil {
			t.Fatal(perr)
		}
		t.Cleanup(pool.Close)
		t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+s.table) })
		b, err = orders.Pgx(pool, nil)
		s.exec = func(t *testing.T, q string, args ...any) {
			t.Helper()
			if _, err := pool.Exec(ctx, q, args...); err != nil {
				t.Fatal(err)
			}
		}
	case "mysql":
		db, derr := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
		if derr != nil {
			t.Fatal(derr)
		}
		t.Cleanup(func() { _ = db.Close() })
		t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + s.table) })
		b, err = orders.SQL(db, orders.MySQL, nil)
		s.exec = sqlExec(db)
	default:
		t.Fatalf("unknown dialect %q", dialect)
	}
	if err != nil {
		t.Fatal(err)
	}
	cfg.Table = s.table
	s.svc, err = orders.New(b, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.svc.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	store := memstore.New(nil)
	t.Cleanup(func() { store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(orders.Authenticate(s.svc.Handler(mw)))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func sqlExec(db *sql.DB) func(t *testing.T, q string, args ...any) {
	return func(t *testing.T, q string, args ...any) {
		t.Helper()
		if _, err := db.Exec(q, args...); err != nil {
			t.Fatal(err)
		}
	}
}

// raw sends one request; auth is the whole Authorization value ("" for none).
func (s *served) raw(t *testing.T, method, path, auth, key, body string) answer {
	t.Helper()
	req, err := http.NewRequest(method, s.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
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

// problemCode checks that a is an application/problem+json answer with status
// want, and returns its code and detail.
// Quote bounds what a failure message repeats.
func Quote(s string) string { return orders.Quote(s) }

func problemCode(t *testing.T, what string, a answer, want int) (code, detail string) {
	t.Helper()
	var p struct{ Code, Detail string }
	if a.status != want || a.header.Get("Content-Type") != "application/problem+json" || json.Unmarshal(a.body, &p) != nil || p.Code == "" {
		t.Errorf("%s: %d %s %.300s; want a %d problem", what, a.status, a.header.Get("Content-Type"), a.body, want)
	}
	return p.Code, p.Detail
}

var dialects = []string{"sqlite", "postgres", "mysql"}

// TestHostileInput sends NUL bytes, invalid UTF-8, over-long values and
// hostile bearer tokens to every endpoint, on every dialect: each is a 4xx
// problem that says what is wrong (PostgreSQL used to answer 500
// database_error), and nothing reaches the orders table.
func TestHostileInput(t *testing.T) {
	t.Parallel()
	for _, dialect := range dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			s := serveDialect(t, dialect, orders.Config{})
			const auth = "Bearer t1"
			for _, path := range []string{"/orders/%00", "/orders/%ff", "/orders/ord_%00", "/orders/" + strings.Repeat("x", 5000), "/orders/ord_%c3%28"} {
				a := s.raw(t, "GET", path, auth, "", "")
				if code, detail := problemCode(t, "GET "+Quote(path), a, 404); code != "order_not_found" || !strings.Contains(detail, "ord_") || len(detail) > 400 {
					t.Errorf("GET %s: code %q detail %q; want order_not_found saying what an order id looks like, in a bounded detail", path, code, detail)
				}
			}
			for _, q := range []string{"cart_id=%00", "cart_id=%ff", "cart_id=c%01", "cart_id=" + strings.Repeat("x", 256), "cart_id=c_42%20", "cart_id="} {
				a := s.raw(t, "GET", "/orders?"+q, auth, "", "")
				if code, detail := problemCode(t, "GET /orders?"+q, a, 400); code != "invalid_query" || !strings.Contains(detail, "cart_id") || len(detail) > 400 {
					t.Errorf("GET /orders?%.40s: code %q detail %q; want invalid_query naming cart_id", q, code, detail)
				}
			}
			bodies := []struct{ body, want string }{
				{`{"cart_id":"c\u0000x","total_cents":1}`, "control character"},
				{"{\"cart_id\":\"c\xffx\",\"total_cents\":1}", "UTF-8"},
				{"{\"cart_id\":\"c\xc3\x28\",\"total_cents\":1}", "UTF-8"},
				{`{"cart_id":"c\u001bx","total_cents":1}`, "control character"},
				{`{"cart_id":" c_42","total_cents":1}`, "space"},
				{`{"cart_id":"c_42 ","total_cents":1}`, "space"},
			}
			for i, c := range bodies {
				a := s.raw(t, "POST", "/orders", auth, fmt.Sprintf("hostile-%d", i), c.body)
				if code, detail := problemCode(t, fmt.Sprintf("POST %q", c.body), a, 400); code != "invalid_order" || !strings.Contains(detail, c.want) {
					t.Errorf("POST %q: code %q detail %q; want invalid_order mentioning %q", c.body, code, detail, c.want)
				}
			}
			for _, tok := range []string{"t\xff1", "t\x80", strings.Repeat("t", 256), "t;1", "t 1"} {
				a := s.raw(t, "POST", "/orders", "Bearer "+tok, "tok-"+fmt.Sprint(len(tok)), `{"cart_id":"c_tok","total_cents":1}`)
				if code, detail := problemCode(t, fmt.Sprintf("token %.20q", tok), a, 401); code != "unauthorized" || !strings.Contains(detail, "token") || len(detail) > 400 {
					t.Errorf("token %.20q: code %q detail %q; want unauthorized saying what is wrong with the token", tok, code, detail)
				}
				if a := s.raw(t, "GET", "/orders", "Bearer "+tok, "", ""); a.status != 401 {
					t.Errorf("GET with token %.20q: %d %s, want 401", tok, a.status, a.body)
				}
			}
			// Valid non-ASCII input still works, and the longest token and cart_id.
			for _, cart := range []string{"café ☕ 𝄞", strings.Repeat("é", orders.MaxCartID/2)} {
				tok := strings.Repeat("T", 255)
				body, _ := json.Marshal(map[string]any{"cart_id": cart, "total_cents": 3})
				if a := s.raw(t, "POST", "/orders", "Bearer "+tok, "ok-"+fmt.Sprint(len(cart)), string(body)); a.status != 201 {
					t.Fatalf("POST cart %q: %d %s, want 201", cart, a.status, a.body)
				}
				a := s.raw(t, "GET", "/orders?cart_id="+url.QueryEscape(cart), "Bearer "+tok, "", "")
				var l struct{ Orders []orders.Order }
				if a.status != 200 || json.Unmarshal(a.body, &l) != nil || len(l.Orders) != 1 || l.Orders[0].CartID != cart {
					t.Fatalf("GET cart %q: %d %s, want the one order", cart, a.status, a.body)
				}
			}
		})
	}
}

// TestPadSpaceCart: MySQL's utf8mb4_bin compares with trailing spaces ignored,
// so "c_pad " used to list the orders of "c_pad". Carts with leading or trailing
// spaces are refused on every dialect.
func TestPadSpaceCart(t *testing.T) {
	t.Parallel()
	s := serveDialect(t, "mysql", orders.Config{})
	if a := s.raw(t, "POST", "/orders", "Bearer t1", "pad-1", `{"cart_id":"c_pad","total_cents":1}`); a.status != 201 {
		t.Fatalf("POST c_pad: %d %s", a.status, a.body)
	}
	a := s.raw(t, "GET", "/orders?cart_id=c_pad%20", "Bearer t1", "", "")
	if a.status == 200 {
		t.Fatalf("GET ?cart_id=\"c_pad \" lists %s: another cart's orders", a.body)
	}
	problemCode(t, "GET ?cart_id=c_pad%20", a, 400)
}

// TestConcurrentHostile fires many hostile requests at once on PostgreSQL (one
// pooled connection per bad statement used to be aborted): none is a 5xx, and
// a valid request afterwards works.
func TestConcurrentHostile(t *testing.T) {
	t.Parallel()
	s := serveDialect(t, "postgres", orders.Config{})
	paths := []string{"/orders/%00", "/orders?cart_id=%00", "/orders?cart_id=%ff", "/orders/%ff"}
	const n = 80
	var wg sync.WaitGroup
	start := make(chan struct{})
	statuses := make([]int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("GET", s.url+paths[i%len(paths)], nil)
			req.Header.Set("Authorization", "Bearer t1")
			<-start
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		}()
	}
	close(start)
	wg.Wait()
	for i, st := range statuses {
		if st < 400 || st >= 500 {
			t.Fatalf("request %d (%s): status %d, want a 4xx", i, paths[i%len(paths)], st)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := s.svc.Orders(ctx, "t1", "c_1"); err != nil {
		t.Fatalf("the pool is unusable after hostile requests: %v", err)
	}
}
