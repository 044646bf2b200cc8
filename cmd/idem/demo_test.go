package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

type httpAnswer struct {
	Status int
	Header http.Header
	Body   []byte
}

// code returns the "code" member of a problem answer.
func (a httpAnswer) code() string {
	var p struct{ Code string }
	_ = json.Unmarshal(a.Body, &p)
	return p.Code
}

func (a httpAnswer) replayed() bool { return a.Header.Get("Idempotent-Replayed") == "true" }

type orderJSON struct {
	ID         string `json:"id"`
	CartID     string `json:"cart_id"`
	TotalCents int64  `json:"total_cents"`
	CreatedAt  string `json:"created_at"`
}

func (a httpAnswer) order(t *testing.T) orderJSON {
	t.Helper()
	var o orderJSON
	if err := json.Unmarshal(a.Body, &o); err != nil || o.ID == "" {
		t.Fatalf("answer %d %s is not an order (%v)", a.Status, a.Body, err)
	}
	return o
}

// send makes one request on a fresh connection (sent exactly once: Go's
// transport re-sends a keyed request on a dropped reused connection). An empty
// tenant sends no Authorization; key "-" sends no Idempotency-Key.
func sendHTTP(t *testing.T, method, url, tenant, key, body string) httpAnswer {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if tenant != "" {
		req.Header.Set("Authorization", "Bearer "+tenant)
	}
	if key != "-" && key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return httpAnswer{resp.StatusCode, resp.Header, data}
}

func listOrders(t *testing.T, base, tenant, cart string) []orderJSON {
	t.Helper()
	a := sendHTTP(t, "GET", base+"/orders?cart_id="+cart, tenant, "-", "")
	var l struct{ Orders []orderJSON }
	if a.Status != 200 || json.Unmarshal(a.Body, &l) != nil {
		t.Fatalf("GET /orders?cart_id=%s: %d %s", cart, a.Status, a.Body)
	}
	return l.Orders
}

// countSQLite counts the orders for cart in the demo's SQLite file, directly.
func countSQLite(t *testing.T, path, cart string) int {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM orders WHERE cart_id = ?", cart).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestDemoCurlArticle runs the concurrency test of the first source article with
// /bin/sh and curl against the demo, exactly as printed there except for the
// port and one added line, -H "Authorization: Bearer t1": the demo requires a
// tenant. uuidgen is not installed everywhere; the script falls back to
// /proc/sys/kernel/random/uuid, which gives the same kind of key.
func TestDemoCurlArticle(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		if testenv.Required() {
			t.Fatal("curl is not installed (IDEM_REQUIRE_SERVICES=1, so this is a failure)")
		}
		t.Skip("curl is not installed; install it to run the article's curl test")
	}
	dir := t.TempDir()
	// The handler sleeps 1 s inside its transaction after the insert: the second
	// curl arrives while the first is in flight.
	d := startDemo(t, dir, nil, "--handler-delay", "1s")
	script := `KEY=$(uuidgen 2>/dev/null || cat /proc/sys/kernel/random/uuid)
for i in 1 2; do
  curl -s -o "resp_$i.json" -w "%{http_code}\n" \
    -X POST http://localhost:` + d.Port + `/orders \
    -H "Authorization: Bearer t1" \
    -H "Idempotency-Key: $KEY" \
    -H "Content-Type: application/json" \
    -d '{"cart_id":"c_42","total_cents":1900}' &
done
wait
`
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("script: %v\n%s", err, out)
	}
	codes := strings.Fields(string(out))
	sort.Strings(codes)
	var bodies [2][]byte
	for i := range bodies {
		bodies[i], err = os.ReadFile(filepath.Join(dir, "resp_"+string(rune('1'+i))+".json"))
		if err != nil {
			t.Fatal(err)
		}
	}
	switch strings.Join(codes, " ") {
	case "201 201":
		// The second was a replay: the same order, byte for byte.
		if string(bodies[0]) != string(bodies[1]) {
			t.Fatalf("two 201s with different bodies, the check-then-write race:\n%s\n%s", bodies[0], bodies[1])
		}
	case "201 409":
	default:
		t.Fatalf("status codes %v, want 201 and a replayed 201 or a 409; bodies:\n%s\n%s", codes, bodies[0], bodies[1])
	}
	if n := countSQLite(t, filepath.Join(dir, "idem-demo.db"), "c_42"); n != 1 {
		t.Fatalf("%d rows in orders for cart c_42, want exactly 1", n)
	}
	if l := listOrders(t, d.URL, "t1", "c_42"); len(l) != 1 {
		t.Fatalf("GET /orders?cart_id=c_42 lists %d orders, want 1", len(l))
	}
	t.Logf("statuses %v", codes)
}

// TestDemoTwoProcessesPostgres runs two demo processes on one PostgreSQL
// database (created for the test) and fires 200 requests with one key, spread
// over both, from one barrier: exactly one order may exist.
func TestDemoTwoProcessesPostgres(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	dir := t.TempDir()
	// Sequential start-up: each migrates the schema at start.
	a := startDemo(t, dir, nil, "--db", dbURL, "--handler-delay", "500ms")
	b := startDemo(t, dir, []string{"IDEM_DB=" + dbURL}, "--handler-delay", "500ms")
	const n = 200
	body := []byte(`{"cart_id":"c_race","total_cents":1900}`)
	urls := [2]string{a.URL + "/orders", b.URL + "/orders"}
	key := "race-" + cliRandHex(8) // one key for all 200
	raceOneKey(t, urls, n, key, body, func() string { return "" })
	var count int
	pg := pgConnect(t, dbURL)
	if err := pg.QueryRow(context.Background(), "SELECT count(*) FROM orders WHERE cart_id = 'c_race'").Scan(&count); err != nil {
		t.Fatal(err)
	}
	if count != 1 {
		t.Fatalf("%d orders in PostgreSQL for the cart, want exactly 1", count)
	}
}

// TestDemoMySQL runs the demo on a MySQL database created for the test and
// races 50 requests with one key at it.
func TestDemoMySQL(t *testing.T) {
	t.Parallel()
	dbURL, db := newMySQLDatabase(t)
	d := startDemo(t, t.TempDir(), nil, "--db", dbURL, "--handler-delay", "300ms")
	key := "my-" + cliRandHex(8)
	results := racetest.Fire(50, racetest.Post(d.URL+"/orders", key, []byte(`{"cart_id":"c_my","total_cents":5}`), http.Header{"Authorization": {"Bearer t1"}}))
	executed := 0
	for _, r := range results {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if r.Status == 201 && r.Header.Get("Idempotent-Replayed") == "" {
			executed++
		} else if r.Status != 201 && r.Status != 409 {
			t.Fatalf("status %d: %s", r.Status, r.Body)
		}
	}
	var count int
	if err := db.QueryRow("SELECT count(*) FROM orders WHERE cart_id = 'c_my'").Scan(&count); err != nil {
		t.Fatal(err)
	}
	if executed != 1 || count != 1 {
		t.Fatalf("%d executed, %d orders in MySQL; want 1 and 1", executed, count)
	}
}

// TestDemoRedisKeys runs the demo with the keys in Redis and the orders in
// SQLite: replays still work.
func TestDemoRedisKeys(t *testing.T) {
	t.Parallel()
	redisURL := testenv.RedisURL(t)
	prefix := "idem-clitest-" + cliRandHex(5) + ":"
	t.Cleanup(func() { deleteRedisPrefix(t, redisURL, prefix) })
	d := startDemo(t, t.TempDir(), nil, "--keys", redisURL, "--table", prefix, "--handler-delay", "300ms")
	if !strings.Contains(d.output(), "orders commit on their own") {
		t.Errorf("the banner does not warn about the weaker guarantee:\n%s", d.output())
	}
	key := "rk-" + cliRandHex(6)
	results := racetest.Fire(20, racetest.Post(d.URL+"/orders", key, []byte(`{"cart_id":"c_rd","total_cents":5}`), http.Header{"Authorization": {"Bearer t1"}}))
	executed := 0
	for _, r := range results {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if r.Status == 201 && r.Header.Get("Idempotent-Replayed") == "" {
			executed++
		}
	}
	if l := listOrders(t, d.URL, "t1", "c_rd"); executed != 1 || len(l) != 1 {
		t.Fatalf("%d executed, %d orders; want 1 and 1", executed, len(l))
	}
}

// TestDemoGracefulShutdown sends SIGINT while a request is inside its handler:
// the request finishes and commits, then the process exits 0.
func TestDemoGracefulShutdown(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--handler-delay", "6s")
	done := make(chan httpAnswer, 1)
	go func() {
		done <- sendHTTP(t, "POST", d.URL+"/orders", "t1", "shutdown-1", `{"cart_id":"c_sd","total_cents":1}`)
	}()
	// The request is sleeping in its transaction: it has 3 s to get there on a
	// loaded machine (700 ms of a 2 s delay was a flake), and sleeps 3 s more.
	time.Sleep(3 * time.Second)
	if err := d.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.Status != 201 {
		t.Fatalf("in-flight request during shutdown: %d %s, want 201", a.Status, a.Body)
	}
	select { // no second SIGINT: that one stops the demo at once
	case <-d.done:
	case <-time.After(40 * time.Second):
		t.Fatalf("the demo did not exit within 40s of SIGINT; output:\n%s", d.output())
	}
	if code := d.code; code != 0 {
		t.Fatalf("exit code %d after SIGINT, want 0; output:\n%s", code, d.output())
	}
	if !strings.Contains(d.output(), "idem demo: stopped") {
		t.Errorf("no stop message:\n%s", d.output())
	}
	if n := countSQLite(t, filepath.Join(dir, "idem-demo.db"), "c_sd"); n != 1 {
		t.Fatalf("%d orders after shutdown, want the in-flight one committed", n)
	}
}

// TestDemoContract drives the contract through the binary, on SQLite.
func TestDemoContract(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil)
	orders := d.URL + "/orders"

	t.Run("replay", func(t *testing.T) {
		t.Parallel()
		key, body := "replay-"+cliRandHex(6), `{"cart_id":"c_replay","total_cents":1900}`
		first := sendHTTP(t, "POST", orders, "t1", key, body)
		if first.Status != 201 || first.replayed() {
			t.Fatalf("first: %d replayed=%v %s", first.Status, first.replayed(), first.Body)
		}
		o := first.order(t)
		if loc := first.Header.Get("Location"); loc != "/orders/"+o.ID {
			t.Fatalf("Location %q, want /orders/%s", loc, o.ID)
		}
		again := sendHTTP(t, "POST", orders, "t1", key, body)
		if again.Status != 201 || !again.replayed() {
			t.Fatalf("retry: %d, Idempotent-Replayed %q; want a replayed 201", again.Status, again.Header.Get("Idempotent-Replayed"))
		}
		if again.Header.Get("Location") != first.Header.Get("Location") || again.Header.Get("Content-Type") != first.Header.Get("Content-Type") {
			t.Fatalf("replayed headers %v differ from %v", again.Header, first.Header)
		}
		if string(again.Body) != string(first.Body) {
			t.Fatalf("replayed body differs:\n%s\n%s", again.Body, first.Body)
		}
		// The IETF sf-string form names the same key.
		quoted := sendHTTP(t, "POST", orders, "t1", `"`+key+`"`, body)
		if quoted.Status != 201 || !quoted.replayed() || string(quoted.Body) != string(first.Body) {
			t.Fatalf("quoted key: %d replayed=%v", quoted.Status, quoted.replayed())
		}
		if l := listOrders(t, d.URL, "t1", "c_replay"); len(l) != 1 || l[0].ID != o.ID {
			t.Fatalf("orders for the cart: %+v, want only %s", l, o.ID)
		}
	})

	t.Run("changed body is 422", func(t *testing.T) {
		t.Parallel()
		key := "changed-" + cliRandHex(6)
		if a := sendHTTP(t, "POST", orders, "t1", key, `{"cart_id":"c_changed","total_cents":1900}`); a.Status != 201 {
			t.Fatalf("first: %d %s", a.Status, a.Body)
		}
		a := sendHTTP(t, "POST", orders, "t1", key, `{"cart_id":"c_changed","total_cents":2900}`)
		if a.Status != 422 || a.code() != "idempotency_key_reused" || a.Header.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("changed body: %d %s %s, want 422 idempotency_key_reused", a.Status, a.Header.Get("Content-Type"), a.Body)
		}
		if l := listOrders(t, d.URL, "t1", "c_changed"); len(l) != 1 {
			t.Fatalf("%d orders, want 1", len(l))
		}
	})

	t.Run("bad keys are 400", func(t *testing.T) {
		t.Parallel()
		body := `{"cart_id":"c_badkey","total_cents":1}`
		if a := sendHTTP(t, "POST", orders, "t1", "-", body); a.Status != 400 || a.code() != "idempotency_key_missing" {
			t.Fatalf("no key: %d %s", a.Status, a.Body)
		}
		long := strings.Repeat("k", 256)
		if a := sendHTTP(t, "POST", orders, "t1", long, body); a.Status != 400 || a.code() != "idempotency_key_invalid" {
			t.Fatalf("256-character key: %d %s", a.Status, a.Body)
		}
		if l := listOrders(t, d.URL, "t1", "c_badkey"); len(l) != 0 {
			t.Fatalf("%d orders after rejected keys, want 0", len(l))
		}
		if a := sendHTTP(t, "POST", orders, "t1", strings.Repeat("k", 254)+cliRandHex(1)[:1], body); a.Status != 201 {
			t.Fatalf("255-character key: %d %s, want 201", a.Status, a.Body)
		}
	})

	t.Run("tenants are isolated", func(t *testing.T) {
		t.Parallel()
		key, body := "tenant-"+cliRandHex(6), `{"cart_id":"c_tenant","total_cents":700}`
		a := sendHTTP(t, "POST", orders, "tenant-a", key, body)
		b := sendHTTP(t, "POST", orders, "tenant-b", key, body)
		if a.Status != 201 || b.Status != 201 || a.replayed() || b.replayed() {
			t.Fatalf("A: %d replayed=%v; B: %d replayed=%v; want two executed 201s", a.Status, a.replayed(), b.Status, b.replayed())
		}
		oa, ob := a.order(t), b.order(t)
		if oa.ID == ob.ID {
			t.Fatalf("tenant B got tenant A's order %s", oa.ID)
		}
		if g := sendHTTP(t, "GET", d.URL+"/orders/"+oa.ID, "tenant-b", "-", ""); g.Status != 404 || g.code() != "order_not_found" {
			t.Fatalf("B reads A's order: %d %s, want 404", g.Status, g.Body)
		}
		if g := sendHTTP(t, "GET", d.URL+"/orders/"+oa.ID, "tenant-a", "-", ""); g.Status != 200 || g.order(t) != oa {
			t.Fatalf("A reads its order: %d %s", g.Status, g.Body)
		}
		if l := listOrders(t, d.URL, "tenant-b", "c_tenant"); len(l) != 1 || l[0].ID != ob.ID {
			t.Fatalf("B's list: %+v", l)
		}
	})

	t.Run("401 is not bound to the key", func(t *testing.T) {
		t.Parallel()
		key := "auth-" + cliRandHex(6)
		// Unauthorized first, with another body: if idem had recorded it, the
		// authorized request below would get 422 or a replayed 401.
		for _, auth := range []string{"", "Bearer "} {
			req, _ := http.NewRequest("POST", orders, strings.NewReader(`{"cart_id":"c_auth","total_cents":1}`))
			req.Header.Set("Idempotency-Key", key)
			if auth != "" {
				req.Header.Set("Authorization", auth)
			}
			resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			data, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			a := httpAnswer{resp.StatusCode, resp.Header, data}
			if a.Status != 401 || a.code() != "unauthorized" || a.Header.Get("Content-Type") != "application/problem+json" {
				t.Fatalf("Authorization %q: %d %s, want 401 unauthorized", auth, a.Status, a.Body)
			}
		}
		a := sendHTTP(t, "POST", orders, "t1", key, `{"cart_id":"c_auth","total_cents":2}`)
		if a.Status != 201 || a.replayed() {
			t.Fatalf("authorized request after 401s: %d replayed=%v %s", a.Status, a.replayed(), a.Body)
		}
	})

	t.Run("handler 400 is replayed", func(t *testing.T) {
		t.Parallel()
		key, body := "invalid-"+cliRandHex(6), `{"cart_id":"c_invalid","total_cents":-5}`
		a := sendHTTP(t, "POST", orders, "t1", key, body)
		if a.Status != 400 || a.code() != "invalid_order" || a.replayed() {
			t.Fatalf("invalid order: %d %s", a.Status, a.Body)
		}
		r := sendHTTP(t, "POST", orders, "t1", key, body)
		if r.Status != 400 || !r.replayed() || string(r.Body) != string(a.Body) {
			t.Fatalf("retry of the invalid order: %d replayed=%v %s, want the stored 400", r.Status, r.replayed(), r.Body)
		}
		for _, bad := range []string{`{"cart_id":"c_invalid","total_cents":19.5}`, `{"total_cents":1}`, `{oops`} {
			if a := sendHTTP(t, "POST", orders, "t1", "invalid-"+cliRandHex(6), bad); a.Status != 400 || a.code() != "invalid_order" {
				t.Fatalf("%s: %d %s, want 400 invalid_order", bad, a.Status, a.Body)
			}
		}
	})

	t.Run("GET passes through without a key", func(t *testing.T) {
		t.Parallel()
		if a := sendHTTP(t, "GET", d.URL+"/orders", "t1", "-", ""); a.Status != 200 {
			t.Fatalf("GET /orders: %d %s", a.Status, a.Body)
		}
		if a := sendHTTP(t, "GET", d.URL+"/healthz", "", "-", ""); a.Status != 200 {
			t.Fatalf("GET /healthz without auth: %d %s", a.Status, a.Body)
		}
		if a := sendHTTP(t, "GET", d.URL+"/nope", "t1", "-", ""); a.Status != 404 {
			t.Fatalf("GET /nope: %d", a.Status)
		}
	})
}

// TestDemoTTL: once a record's TTL has passed, the same key executes again.
func TestDemoTTL(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), []string{"IDEM_TTL=1h"}, "--ttl", "4s", "--lease", "1s")
	if !strings.Contains(d.output(), "ttl 4s") {
		t.Errorf("the flag did not win over IDEM_TTL:\n%s", d.output())
	}
	key, body := "ttl-"+cliRandHex(6), `{"cart_id":"c_ttl","total_cents":1}`
	first := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
	if first.Status != 201 {
		t.Fatalf("first: %d %s", first.Status, first.Body)
	}
	expired := time.Now().Add(5 * time.Second)
	if r := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body); r.Status != 201 || !r.replayed() {
		t.Fatalf("retry within the TTL: %d replayed=%v", r.Status, r.replayed())
	}
	time.Sleep(time.Until(expired))
	again := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
	if again.Status != 201 || again.replayed() || again.order(t).ID == first.order(t).ID {
		t.Fatalf("after the TTL: %d replayed=%v %s, want a new order", again.Status, again.replayed(), again.Body)
	}
	if l := listOrders(t, d.URL, "t1", "c_ttl"); len(l) != 2 {
		t.Fatalf("%d orders, want 2 (one per TTL window)", len(l))
	}
}

// TestDemoRateLimit: 429s come before idem and are never bound to a key.
func TestDemoRateLimit(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), []string{"IDEM_RATE_LIMIT=2"})
	const n = 12
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "rl-" + cliRandHex(6)
	}
	body := []byte(`{"cart_id":"c_rl","total_cents":1}`)
	results := racetest.Fire(n, func(i int) (*http.Request, error) {
		return racetest.Post(d.URL+"/orders", keys[i], body, http.Header{"Authorization": {"Bearer t1"}})(i)
	})
	limited := -1
	for i, r := range results {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if r.Status == 429 {
			var p struct{ Code string }
			_ = json.Unmarshal(r.Body, &p)
			if p.Code != "rate_limited" || r.Header.Get("Retry-After") == "" {
				t.Fatalf("429 without the rate_limited problem or Retry-After: %v %s", r.Header, r.Body)
			}
			limited = i
		} else if r.Status != 201 {
			t.Fatalf("status %d: %s", r.Status, r.Body)
		}
	}
	if limited < 0 {
		t.Fatalf("%d requests at once with --rate-limit 2 (IDEM_RATE_LIMIT): none was limited", n)
	}
	// Another tenant is not limited by t1's burst.
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t2", "rl-other-"+cliRandHex(4), string(body)); a.Status != 201 {
		t.Fatalf("tenant t2: %d %s", a.Status, a.Body)
	}
	// The limited key was never recorded: once the window passed it executes.
	var a httpAnswer
	for range 10 {
		time.Sleep(1500 * time.Millisecond)
		if a = sendHTTP(t, "POST", d.URL+"/orders", "t1", keys[limited], string(body)); a.Status != 429 {
			break
		}
	}
	if a.Status != 201 || a.replayed() {
		t.Fatalf("retry of a rate-limited key: %d replayed=%v %s, want an executed 201", a.Status, a.replayed(), a.Body)
	}
}

// TestDemoUsage covers --help and bad flags or environment values.
func TestDemoUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, out, _ := runIdem(t, dir, nil, "demo", "--help")
	if code != 0 || !strings.Contains(out, "Example:") || !strings.Contains(out, "--handler-delay") || !strings.Contains(out, "[IDEM_HANDLER_DELAY]") {
		t.Fatalf("demo --help: exit %d\n%s", code, out)
	}
	cases := []struct {
		env  []string
		args []string
		want string
	}{
		{nil, []string{"demo", "--nope"}, "unknown flag --nope"},
		{nil, []string{"demo", "--lease", "soon"}, `invalid value "soon" for --lease; use a duration such as 500ms, 30s or 24h`},
		{nil, []string{"demo", "--require-key=maybe"}, `invalid value "maybe" for --require-key; use true or false`},
		{[]string{"IDEM_LEASE=soon"}, []string{"demo"}, `IDEM_LEASE="soon" is not a valid value for --lease`},
		{[]string{"IDEM_REQUIRE_KEY=maybe"}, []string{"demo"}, `IDEM_REQUIRE_KEY="maybe" is not a valid value for --require-key; use true or false`},
		{nil, []string{"demo", "--ttl", "1s", "--lease", "2s"}, "invalid --ttl 1s: shorter than --lease (2s)"},
		{nil, []string{"demo", "--handler-delay", "-1s"}, "--handler-delay -1s is negative"},
		{nil, []string{"demo", "--rate-limit", "-3"}, "--rate-limit -3 is negative"},
		{nil, []string{"demo", "--flow", "nope"}, `invalid value "nope" for --flow; use auto, claim-complete or single-tx`},
		{nil, []string{"demo", "--db", "x://foo"}, `--db: unknown scheme "x"; use sqlite:PATH, postgres://… or mysql://…`},
		{nil, []string{"demo", "--keys", "memcached://x"}, `--keys: unknown scheme "memcached"`},
		{nil, []string{"demo", "extra"}, `unexpected argument "extra"`},
		{nil, []string{"demo", "--addr", "notaport"}, `--addr "notaport" is not HOST:PORT; write for example 127.0.0.1:8080`},
		{nil, []string{"demo", "--addr", "127.0.0.1:99999"}, `port "99999" is not a number from 0 to 65535`},
		{nil, []string{"demo", "--metrics-addr", "9464"}, `--metrics-addr "9464" is not HOST:PORT`},
	}
	for _, c := range cases {
		code, _, stderr := runIdem(t, dir, c.env, c.args...)
		if code != 2 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "--help") {
			t.Errorf("%v %v: exit %d, stderr %q; want 2 and %q", c.env, c.args, code, stderr, c.want)
		}
	}
	// An address in use is a failure (1), not a usage error.
	d := startDemo(t, dir, nil)
	code, _, stderr := runIdem(t, dir, nil, "demo", "--addr", "127.0.0.1:"+d.Port)
	if code != 1 || !strings.Contains(stderr, "--addr") {
		t.Errorf("address in use: exit %d, stderr %q", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "idem-demo.db")); err != nil {
		t.Errorf("the default database file was not created in the working directory: %v", err)
	}
}

// TestDemoCrash kills the demo (SIGKILL) while a request sleeps in its
// transaction after the insert: nothing of it survives, the key stays in flight
// until its lease lapses, and then a retry on a restarted demo executes once.
func TestDemoCrash(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := startDemo(t, dir, nil, "--flow", "claim-complete", "--lease", "1s", "--handler-delay", "6s")
	key, body := "crash-"+cliRandHex(6), `{"cart_id":"c_crash","total_cents":1}`
	go func() {
		req, _ := http.NewRequest("POST", a.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", key)
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	time.Sleep(3 * time.Second) // inside the handler's transaction (3 s to get there, 3 s to spare)
	if err := a.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-a.done
	if n := countSQLite(t, filepath.Join(dir, "idem-demo.db"), "c_crash"); n != 0 {
		t.Fatalf("%d orders after the crash, want 0 (the transaction never committed)", n)
	}
	// The crashed request's claim is still there, in flight.
	code, out, _ := runIdem(t, dir, nil, "inspect", "--db", "sqlite:"+filepath.Join(dir, "idem-demo.db"), "--scope", "t1", key)
	if code != 0 || !strings.Contains(out, "state:       in_flight") {
		t.Fatalf("the killed request left no in-flight claim (exit %d):\n%s", code, out)
	}
	b := startDemo(t, dir, nil, "--lease", "1s")
	var r httpAnswer
	deadline := time.Now().Add(30 * time.Second)
	for {
		r = sendHTTP(t, "POST", b.URL+"/orders", "t1", key, body)
		if r.Status != 409 || time.Now().After(deadline) {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	if r.Status != 201 || r.replayed() {
		t.Fatalf("retry after the crash: %d replayed=%v %s, want an executed 201", r.Status, r.replayed(), r.Body)
	}
	if n := countSQLite(t, filepath.Join(dir, "idem-demo.db"), "c_crash"); n != 1 {
		t.Fatalf("%d orders, want exactly 1", n)
	}
}

// TestDemoKeyOptional: with --require-key=false a POST without a key runs
// unprotected, and keyed ones are still deduplicated.
func TestDemoKeyOptional(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), []string{"IDEM_REQUIRE_KEY=false"})
	body := `{"cart_id":"c_opt","total_cents":1}`
	for range 2 {
		if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "-", body); a.Status != 201 || a.replayed() {
			t.Fatalf("POST without a key: %d %s", a.Status, a.Body)
		}
	}
	key := "opt-" + cliRandHex(4)
	sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body); !a.replayed() {
		t.Fatalf("keyed retry not replayed: %d", a.Status)
	}
	if l := listOrders(t, d.URL, "t1", "c_opt"); len(l) != 3 {
		t.Fatalf("%d orders, want 3 (two unkeyed, one keyed)", len(l))
	}
}

// TestDemoSecondInterrupt: a second SIGINT during the graceful shutdown stops the
// demo at once, without waiting for the request in flight.
func TestDemoSecondInterrupt(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), nil, "--handler-delay", "20s")
	go func() {
		req, _ := http.NewRequest("POST", d.URL+"/orders", strings.NewReader(`{"cart_id":"c_int","total_cents":1}`))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", "int-"+cliRandHex(4))
		if resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	time.Sleep(3 * time.Second) // the request is in its 20 s handler (700 ms was a flake under load)
	_ = d.cmd.Process.Signal(os.Interrupt)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(d.output(), "shutting down") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	start := time.Now()
	_ = d.cmd.Process.Signal(os.Interrupt)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("the demo still runs 10s after the second SIGINT (the request sleeps 20s)")
	}
	if d.code == 0 {
		t.Errorf("exit code 0 after a forced stop")
	}
	t.Logf("stopped %v after the second SIGINT", time.Since(start).Round(time.Millisecond))
}

// rawExchange writes req on a new connection to addr and returns what the
// server sent until it closed the connection, and how long that took; it fails
// the test if the server holds the connection for longer than hold.
func rawExchange(t *testing.T, addr, req string, hold time.Duration) (string, time.Duration) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Error(err)
		return "", 0
	}
	defer c.Close()
	start := time.Now()
	if _, err := io.WriteString(c, req); err != nil {
		t.Error(err)
		return "", 0
	}
	_ = c.SetReadDeadline(start.Add(hold))
	data, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("after %v the server still holds the connection (%v); got %q", time.Since(start).Round(time.Millisecond), err, data)
	}
	return string(data), time.Since(start)
}

// TestDemoSlowBody: 200 connections at once send a POST's headers and a part of
// its body, then nothing. With --read-timeout 1s each is answered or dropped
// within seconds (the demo had no body read timeout: they were held for
// minutes), and the demo keeps serving. Headers over 64 KiB are refused.
func TestDemoSlowBody(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), []string{"IDEM_READ_TIMEOUT=1s"})
	addr := "127.0.0.1:" + d.Port
	const n = 200
	var wg sync.WaitGroup
	start := make(chan struct{})
	var mu sync.Mutex
	var slowest time.Duration
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := "POST /orders HTTP/1.1\r\nHost: demo\r\nAuthorization: Bearer t1\r\nIdempotency-Key: slow-" + strconv.Itoa(i) +
				"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"cart_id\":"
			<-start
			_, took := rawExchange(t, addr, req, 20*time.Second)
			mu.Lock()
			slowest = max(slowest, took)
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	t.Logf("%d half-sent bodies: the last connection was closed after %v", n, slowest.Round(time.Millisecond))
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "after-slow", `{"cart_id":"c_slow","total_cents":1}`); a.Status != 201 {
		t.Fatalf("a normal request after the slow ones: %d %s", a.Status, a.Body)
	}
	// A half-sent header is dropped too (ReadHeaderTimeout ≤ --read-timeout).
	rawExchange(t, addr, "GET /orders HTTP/1.1\r\nHost: demo\r\nAuthoriza", 20*time.Second)
	big := "GET /orders HTTP/1.1\r\nHost: demo\r\nAuthorization: Bearer " + strings.Repeat("a", 100<<10) + "\r\n\r\n"
	if got, _ := rawExchange(t, addr, big, 20*time.Second); !strings.HasPrefix(got, "HTTP/1.1 431") {
		t.Errorf("100 KiB of headers: %.100q, want 431", got)
	}
}

// TestDemoHostileInputDatabases drives the built demo on PostgreSQL and MariaDB
// with NUL bytes, invalid UTF-8 and hostile bearer tokens: every answer is a
// 4xx problem (PostgreSQL answered 500 database_error), the stderr log stays
// small (a 3 KB token used to be logged whole with the store error it caused),
// and a valid order still works.
func TestDemoHostileInputDatabases(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"postgres", "mysql"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var dbURL string
			if name == "postgres" {
				dbURL = newPostgresDatabase(t)
			} else {
				dbURL, _ = newMySQLDatabase(t)
			}
			d := startDemo(t, t.TempDir(), nil, "--db", dbURL)
			type req struct{ method, path, auth, body string }
			reqs := []req{
				{"GET", "/orders/%00", "Bearer t1", ""},
				{"GET", "/orders/%ff", "Bearer t1", ""},
				{"GET", "/orders?cart_id=%00", "Bearer t1", ""},
				{"GET", "/orders?cart_id=%ff", "Bearer t1", ""},
				{"GET", "/orders?after=%00", "Bearer t1", ""},
				{"POST", "/orders", "Bearer t1", `{"cart_id":"c\u0000","total_cents":1}`},
				{"POST", "/orders", "Bearer t1", "{\"cart_id\":\"c\xff\",\"total_cents\":1}"},
				{"POST", "/orders", "Bearer t\xff1", `{"cart_id":"c_1","total_cents":1}`},
				{"GET", "/orders", "Bearer t\xff1", ""},
				{"POST", "/orders", "Bearer " + strings.Repeat("a", 3000), `{"cart_id":"c_1","total_cents":1}`},
				{"POST", "/orders", "Bearer " + strings.Repeat("b", 60000), `{"cart_id":"c_1","total_cents":1}`},
				{"POST", "/orders", "Bearer " + strings.Repeat("c", 900<<10), `{"cart_id":"c_1","total_cents":1}`},
			}
			for i, r := range reqs {
				hr, err := http.NewRequest(r.method, d.URL+r.path, strings.NewReader(r.body))
				if err != nil {
					t.Fatal(err)
				}
				hr.Header.Set("Authorization", r.auth)
				hr.Header.Set("Idempotency-Key", "hostile-"+strconv.Itoa(i))
				resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(hr)
				if err != nil {
					t.Fatalf("%s %s: %v", r.method, r.path, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode < 400 || resp.StatusCode > 499 {
					t.Errorf("%s %s (token %d bytes, body %.40q): %d %.200s, want a 4xx", r.method, r.path, len(r.auth), r.body, resp.StatusCode, body)
				}
				if resp.StatusCode != 431 && resp.Header.Get("Content-Type") != "application/problem+json" {
					t.Errorf("%s %s: %d with %q, want a problem", r.method, r.path, resp.StatusCode, resp.Header.Get("Content-Type"))
				}
			}
			if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "fine", `{"cart_id":"c_ok ☕","total_cents":1}`); a.Status != 201 {
				t.Fatalf("valid order: %d %s", a.Status, a.Body)
			}
			if out := d.output(); len(out) > 8<<10 || strings.Contains(out, strings.Repeat("a", 300)) {
				t.Fatalf("the log repeats client input (%d bytes):\n%.2000s", len(out), out)
			}
		})
	}
}

// TestDemoLoggerBounds: whatever a log line carries (message, string, error),
// at most demoMaxLogValue bytes of it are written.
func TestDemoLoggerBounds(t *testing.T) {
	t.Parallel()
	var buf strings.Builder
	logger := demoLogger(&buf)
	huge := strings.Repeat("x", 900<<10)
	demoObserver(logger).Observe(context.Background(), idem.Event{Kind: idem.EventStoreError, Scope: huge, Key: "k", Err: errors.New(huge)})
	logger.Warn(huge, "value", huge)
	if buf.Len() > 2000 || !strings.Contains(buf.String(), "(921600 bytes)") {
		t.Fatalf("%d bytes logged for two lines carrying 900 KB values:\n%.3000s", buf.Len(), buf.String())
	}
}

// blackHole accepts TCP connections and never answers: a database that hangs.
func blackHole(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// startRaw starts `idem demo args…` and returns it once its first line is out,
// without waiting for /healthz.
func startRaw(t *testing.T, env []string, args ...string) (d *demoProc, first string, took time.Duration) {
	t.Helper()
	d = &demoProc{done: make(chan struct{})}
	d.cmd = exec.Command(idemBin, append([]string{"demo", "--addr", "127.0.0.1:0"}, args...)...)
	d.cmd.Dir = t.TempDir()
	d.cmd.Env = cliEnv(env...)
	d.cmd.Stderr = cliLockedBuf{&d.mu, &d.errb}
	stdout, err := d.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1)
	go func() {
		r := bufio.NewReader(stdout)
		line, _ := r.ReadString('\n')
		lines <- strings.TrimRight(line, "\n")
		_, _ = io.Copy(cliLockedBuf{&d.mu, &d.out}, r)
	}()
	go func() {
		_ = d.cmd.Wait()
		d.code = d.cmd.ProcessState.ExitCode()
		close(d.done)
	}()
	t.Cleanup(func() { d.stop(t) })
	select {
	case first = <-lines:
	case <-time.After(30 * time.Second):
		t.Fatalf("no output in 30s:\n%s", d.output())
	}
	took = time.Since(began)
	if m := listenRE.FindStringSubmatch(first); m != nil {
		d.URL, d.Port = m[1], m[2]
	}
	return d, first, took
}

// TestDemoListensFirst: with a database that hangs, the demo says where it
// listens at once (it used to print nothing until the database answered or its
// 10 s ping gave up), answers 503 with Retry-After meanwhile, and Ctrl-C stops
// it at once and cleanly.
func TestDemoListensFirst(t *testing.T) {
	t.Parallel()
	for _, sig := range []os.Signal{os.Interrupt, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			d, first, took := startRaw(t, nil, "--db", "postgres://postgres@"+blackHole(t)+"/test?sslmode=disable")
			if d.URL == "" || took > 5*time.Second {
				t.Fatalf("first line %q after %v; want the address within 5s", first, took)
			}
			resp, err := http.Get(d.URL + "/orders")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
				t.Fatalf("while starting: %d Retry-After %q, want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
			}
			_ = d.cmd.Process.Signal(sig)
			select {
			case <-d.done:
			case <-time.After(5 * time.Second):
				t.Fatalf("still running 5s after %v during start-up:\n%s", sig, d.output())
			}
			if d.code != 0 || !strings.Contains(d.output(), "idem demo: stopped") {
				t.Fatalf("exit %d after %v during start-up, want 0 and a stop message:\n%s", d.code, sig, d.output())
			}
		})
	}
}

// TestDemoSIGTERM: SIGTERM stops a serving demo as cleanly as Ctrl-C.
func TestDemoSIGTERM(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), nil)
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("still running 20s after SIGTERM:\n%s", d.output())
	}
	if d.code != 0 || !strings.Contains(d.output(), "interrupted") || !strings.Contains(d.output(), "idem demo: stopped") {
		t.Fatalf("exit %d after SIGTERM:\n%s", d.code, d.output())
	}
}

// TestDemoExitsWithParent starts the demo from a shell, as `go run` does, and
// kills the shell with SIGKILL: the orphaned demo used to serve on; now it
// notices and stops cleanly.
func TestDemoExitsWithParent(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	errFile := filepath.Join(dir, "stderr")
	sh := exec.Command("/bin/sh", "-c", `"$0" demo --addr 127.0.0.1:0 2>"$1" & echo "pid $!"; wait`, idemBin, errFile)
	sh.Dir = dir
	sh.Env = cliEnv()
	out, err := sh.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(out)
	var pid int
	var url string
	for pid == 0 || url == "" {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("reading the shell's output: %v", err)
		}
		line = strings.TrimSpace(line)
		if p, ok := strings.CutPrefix(line, "pid "); ok {
			pid, _ = strconv.Atoi(p)
			t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
		}
		if m := listenRE.FindStringSubmatch(line); m != nil {
			url = m[1]
		}
	}
	exited := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, r); close(exited) }() // EOF: the demo closed its stdout
	_ = sh.Process.Kill()
	_, _ = sh.Process.Wait() // not sh.Wait: it would close the pipe before the demo's EOF
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("the demo (pid %d) still runs 15s after its parent was killed", pid)
	}
	_ = sh.Wait()
	if _, err := http.Get(url + "/healthz"); err == nil {
		t.Fatalf("the demo still answers at %s", url)
	}
	log, _ := os.ReadFile(errFile)
	if !strings.Contains(string(log), "the process that started the demo exited") || !strings.Contains(string(log), "idem demo: stopped") {
		t.Fatalf("no clean stop in the log:\n%s", log)
	}
}

// TestDemoPrefixSchema: --schema (PostgreSQL) and --prefix put both tables
// where they are asked for; --schema on MySQL is a usage error that says what
// to do; --help says which tables the demo creates.
func TestDemoPrefixSchema(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		dbURL := newPostgresDatabase(t)
		d := startDemo(t, t.TempDir(), []string{"IDEM_SCHEMA=shop"}, "--db", dbURL, "--prefix", "p_")
		if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "schema-1", `{"cart_id":"c_s","total_cents":1}`); a.Status != 201 {
			t.Fatalf("POST: %d %s", a.Status, a.Body)
		}
		pg := pgConnect(t, dbURL)
		rows, err := pg.Query(context.Background(), "SELECT table_schema || '.' || table_name FROM information_schema.tables WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1")
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(names, " ") != "shop.p_idem_records shop.p_idem_records_steps shop.p_orders" {
			t.Fatalf("tables %v, want shop.p_idem_records, shop.p_idem_records_steps and shop.p_orders only", names)
		}
		var n int
		if err := pg.QueryRow(context.Background(), "SELECT count(*) FROM shop.p_orders WHERE cart_id = 'c_s'").Scan(&n); err != nil || n != 1 {
			t.Fatalf("%d orders in shop.p_orders (%v), want 1", n, err)
		}
		if !strings.Contains(d.output(), "table shop.p_orders") {
			t.Errorf("the banner does not name the orders table:\n%s", d.output())
		}
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		dbURL, db := newMySQLDatabase(t)
		d := startDemo(t, t.TempDir(), nil, "--db", dbURL, "--prefix", "m_")
		if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "prefix-1", `{"cart_id":"c_m","total_cents":1}`); a.Status != 201 {
			t.Fatalf("POST: %d %s", a.Status, a.Body)
		}
		rows, err := db.Query("SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() ORDER BY 1")
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var names []string
		for rows.Next() {
			var s string
			_ = rows.Scan(&s)
			names = append(names, s)
		}
		if strings.Join(names, " ") != "m_idem_records m_idem_records_migrations m_idem_records_steps m_orders" {
			t.Fatalf("tables %v, want the m_ ones only", names)
		}
		code, _, stderr := runIdem(t, t.TempDir(), nil, "demo", "--db", dbURL, "--schema", "shop")
		if code != 2 || !strings.Contains(stderr, "name it in --db") {
			t.Fatalf("--schema on MySQL: exit %d %s", code, stderr)
		}
	})
	code, out, _ := runIdem(t, t.TempDir(), nil, "demo", "--help")
	if code != 0 || !strings.Contains(out, "CREATES TABLES") || !strings.Contains(out, "--schema") || !strings.Contains(out, "--prefix") || !strings.Contains(out, "  --exit-with-parent\n") {
		t.Fatalf("--help does not say which tables the demo creates:\n%s", out)
	}
	for _, bad := range [][]string{{"--prefix", "Bad-"}, {"--schema", "a.b"}, {"--read-timeout", "0s"}} {
		if code, _, stderr := runIdem(t, t.TempDir(), nil, append([]string{"demo"}, bad...)...); code != 2 || !strings.Contains(stderr, bad[0]) {
			t.Errorf("%v: exit %d %s, want a usage error", bad, code, stderr)
		}
	}
}

// TestDemoDatabaseFailureNotKept: an order that failed because the database
// did (here: its table was renamed away) is not stored as the key's outcome; the
// retry with the same key, once the database is back, creates the order. It
// used to replay the 500 until the TTL.
func TestDemoDatabaseFailureNotKept(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil)
	db, err := embedded.Open(filepath.Join(dir, "idem-demo.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec("ALTER TABLE orders RENAME TO orders_away"); err != nil {
		t.Fatal(err)
	}
	body := `{"cart_id":"c_fail","total_cents":1}`
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "fail-1", body); a.Status != 500 || a.code() != "order_not_saved" {
		t.Fatalf("with the table gone: %d %s, want 500 order_not_saved", a.Status, a.Body)
	}
	if _, err := db.Exec("ALTER TABLE orders_away RENAME TO orders"); err != nil {
		t.Fatal(err)
	}
	a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "fail-1", body)
	if a.Status != 201 || a.replayed() {
		t.Fatalf("retry once the table is back: %d replayed=%v %s, want an executed 201", a.Status, a.replayed(), a.Body)
	}
}

var metricsRE = regexp.MustCompile(`metrics: (http://127\.0\.0\.1:\d+/metrics)`)

// TestDemoMetrics: the demo serves GET /metrics on its own address without a
// token; after an executed order, its replay, a 422 and a 400, the scrape
// (parsed by the Prometheus text parser) counts each exactly once, the store
// operations are timed, nothing is held in flight, and no key is a label.
func TestDemoMetrics(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), nil, "--metrics-addr", "127.0.0.1:0")
	m := metricsRE.FindStringSubmatch(d.output())
	if m == nil {
		t.Fatalf("the banner names no metrics address:\n%s", d.output())
	}
	key := "metrics-" + cliRandHex(6)
	body := `{"cart_id":"c_metrics","total_cents":100}`
	for i, want := range []int{201, 201} {
		if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body); a.Status != want {
			t.Fatalf("POST %d: %d %s", i, a.Status, a.Body)
		}
	}
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, `{"cart_id":"c_other","total_cents":1}`); a.Status != 422 {
		t.Fatalf("reused key: %d %s", a.Status, a.Body)
	}
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "", body); a.Status != 400 {
		t.Fatalf("no key: %d %s", a.Status, a.Body)
	}
	resp, err := http.Get(m[1]) // no Authorization: scrapers send none
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /metrics: %d %s", resp.StatusCode, raw)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(raw)))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	got := map[string]float64{}
	for name, f := range fams {
		for _, mt := range f.Metric {
			label := ""
			for _, l := range mt.Label {
				if strings.Contains(l.GetValue(), key) {
					t.Errorf("%s has the key as label %s", name, l.GetName())
				}
				label += "{" + l.GetValue() + "}"
			}
			switch {
			case mt.Counter != nil:
				got[name+label] = mt.Counter.GetValue()
			case mt.Gauge != nil:
				got[name+label] = mt.Gauge.GetValue()
			case mt.Histogram != nil:
				got[name+label] = float64(mt.Histogram.GetSampleCount())
			}
		}
	}
	for k, want := range map[string]float64{
		"idem_requests_total{executed}": 1, "idem_requests_total{replayed}": 1, "idem_requests_total{mismatch}": 1,
		"idem_requests_total{rejected}": 1, "idem_requests_total{store_error}": 0, "idem_in_flight": 0,
		"idem_store_errors_total{claim}": 0,
	} {
		if v, ok := got[k]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", k, v, ok, want)
		}
	}
	// Each keyed request that reached the store started with a claim
	// (claim-then-complete) or a locked transaction (single-transaction flow);
	// one transaction committed.
	claims, begins := got["idem_store_duration_seconds{claim}"], got["idem_store_duration_seconds{begin}"]
	if claims != 3 && begins != 3 {
		t.Errorf("claims %v, begins %v; want 3 of one of them (one per keyed request)", claims, begins)
	}
	if c := got["idem_store_duration_seconds{commit}"]; c != 1 {
		t.Errorf("commits %v, want 1", c)
	}
}

// raceOneKey fires n POSTs of body with key (tenant t1) from one barrier,
// alternating between the two urls, and fails t unless exactly one executed,
// the others were replays or 409s, and every 201 is the executed one; about
// adds context to a failure (the servers' logs).
func raceOneKey(t *testing.T, urls [2]string, n int, key string, body []byte, about func() string) {
	t.Helper()
	hdr := http.Header{"Authorization": {"Bearer t1"}}
	results := racetest.Fire(n, func(i int) (*http.Request, error) {
		return racetest.Post(urls[i%2], key, body, hdr)(i)
	})
	var executed, replayed, inFlight int
	var created []byte
	for _, r := range results {
		switch {
		case r.Err != nil:
			t.Fatalf("request failed: %v", r.Err)
		case r.Status == 201 && r.Header.Get("Idempotent-Replayed") == "true":
			replayed++
		case r.Status == 201:
			executed++
			created = r.Body
		case r.Status == 409:
			inFlight++
		default:
			t.Fatalf("status %d: %s%s", r.Status, r.Body, about())
		}
	}
	if executed != 1 {
		t.Fatalf("%d requests executed (not replayed), want exactly 1 (replayed %d, 409 %d)", executed, replayed, inFlight)
	}
	for _, r := range results {
		if r.Status == 201 && string(r.Body) != string(created) {
			t.Fatalf("a 201 differs from the executed one:\n%s\n%s", r.Body, created)
		}
	}
	t.Logf("%d requests over 2 processes: 1 executed, %d replayed, %d answered 409", n, replayed, inFlight)
}

// TestDemoBannerShowsEffectiveLease: --lease 0 and --ttl 0 mean the defaults,
// and the banner says what is in force (it printed "lease 0s").
func TestDemoBannerShowsEffectiveLease(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--db", "sqlite:"+filepath.Join(dir, "b.db"), "--lease", "0", "--ttl", "0", "--metrics-addr", "")
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(d.output(), "handler delay") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	want := fmt.Sprintf("lease %v, ttl %v,", idem.DefaultLease, idem.DefaultTTL)
	if out := d.output(); !strings.Contains(out, want) {
		t.Fatalf("the banner does not say %q:\n%s", want, out)
	}
}

// TestDemoConfigErrorPrefix: a refused --ttl says "idem demo: invalid --ttl …"
// once, not "idem demo: idem: invalid config: …".
func TestDemoConfigErrorPrefix(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, _, stderr := runIdem(t, dir, nil, "demo", "--db", "sqlite:"+filepath.Join(dir, "t.db"), "--ttl", "1s")
	if code != exitUsage || !strings.HasPrefix(stderr, "idem demo: invalid --ttl 1s: shorter than --lease (30s)") || strings.Contains(stderr, "idem: ") {
		t.Fatalf("--ttl 1s: exit %d, stderr %q; want 2 and one prefix", code, stderr)
	}
}

// TestProxyConfigErrorPrefix: a setting the core refuses is named once, by
// its flag, after one "idem proxy: " (it read "idem proxy: proxy: route 1
// (…): idem: invalid config: invalid TTL 1s …").
func TestProxyConfigErrorPrefix(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, _, stderr := runIdem(t, dir, nil, "proxy", "--upstream", "http://127.0.0.1:1", "--db", "sqlite:"+filepath.Join(dir, "k.db"),
		"--route", "POST /orders", "--scope", "none", "--ttl", "1s")
	if code != exitUsage || !strings.HasPrefix(stderr, `idem proxy: route 1 ("POST /orders"): invalid --ttl 1s: shorter than --lease (30s)`) || strings.Contains(stderr, "idem: ") || strings.Contains(stderr, "proxy: proxy:") {
		t.Fatalf("--ttl 1s: exit %d, stderr %q; want 2 and one prefix", code, stderr)
	}
}
