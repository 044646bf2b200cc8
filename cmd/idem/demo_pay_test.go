package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/orders/fakepay"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// The tests of idem demo --payment-url: every new order is charged at a fake
// payment provider (package fakepay, a real loopback HTTP server in the test
// process) before it is inserted, and the demo runs as a real process that the
// tests kill with SIGKILL.

// payDB is the business database of a demo under test.
type payDB struct {
	name string
	db   string // the --db value
	dir  string // the demo's working directory
	// orders returns the committed orders of cart: id → charge_id.
	orders func(t *testing.T, cart string) map[string]string
}

func sqlitePayDB(t *testing.T) payDB {
	dir := t.TempDir()
	path := filepath.Join(dir, "shop.db")
	return payDB{name: "sqlite", db: "sqlite:" + path, dir: dir, orders: func(t *testing.T, cart string) map[string]string {
		t.Helper()
		db, err := embedded.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		rows, err := db.Query("SELECT id, COALESCE(charge_id, '') FROM orders WHERE cart_id = ?", cart)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[string]string{}
		for rows.Next() {
			var id, charge string
			if err := rows.Scan(&id, &charge); err != nil {
				t.Fatal(err)
			}
			out[id] = charge
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}}
}

func postgresPayDB(t *testing.T) payDB {
	u := newPostgresDatabase(t)
	conn := pgConnect(t, u)
	return payDB{name: "postgres", db: u, dir: t.TempDir(), orders: func(t *testing.T, cart string) map[string]string {
		t.Helper()
		rows, err := conn.Query(context.Background(), "SELECT id, COALESCE(charge_id, '') FROM orders WHERE cart_id = $1", cart)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[string]string{}
		for rows.Next() {
			var id, charge string
			if err := rows.Scan(&id, &charge); err != nil {
				t.Fatal(err)
			}
			out[id] = charge
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}}
}

func mysqlPayDB(t *testing.T) payDB {
	u, db := newMySQLDatabase(t)
	return payDB{name: "mysql", db: u, dir: t.TempDir(), orders: func(t *testing.T, cart string) map[string]string {
		t.Helper()
		rows, err := db.Query("SELECT id, COALESCE(charge_id, '') FROM orders WHERE cart_id = ?", cart)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[string]string{}
		for rows.Next() {
			var id, charge string
			if err := rows.Scan(&id, &charge); err != nil {
				t.Fatal(err)
			}
			out[id] = charge
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}}
}

type payOpener struct {
	name string
	open func(*testing.T) payDB
}

// payStores runs f for SQLite and PostgreSQL (and more), each in a subtest.
func payStores(t *testing.T, f func(t *testing.T, db payDB), more ...payOpener) {
	for _, s := range append([]payOpener{{"sqlite", sqlitePayDB}, {"postgres", postgresPayDB}}, more...) {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			f(t, s.open(t))
		})
	}
}

// startPayDemo starts the demo on db, charging at p, with args.
func startPayDemo(t *testing.T, db payDB, p *fakepay.Provider, args ...string) *demoProc {
	t.Helper()
	return startDemo(t, db.dir, nil, append([]string{"--db", db.db, "--payment-url", p.URL, "--metrics-addr", ""}, args...)...)
}

// payOrder is what the tests send: one cart, one total.
func payOrder(cart string) string {
	return fmt.Sprintf(`{"cart_id":%q,"total_cents":1900}`, cart)
}

// sendAsync sends one POST /orders on a fresh connection and delivers its
// answer (status 0 when the connection broke, as it does when the demo is
// killed).
func sendAsync(url, key, body string) <-chan httpAnswer {
	ch := make(chan httpAnswer, 1)
	go func() {
		req, _ := http.NewRequest("POST", url+"/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := (&http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err != nil {
			ch <- httpAnswer{}
			return
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		ch <- httpAnswer{resp.StatusCode, resp.Header, data}
	}()
	return ch
}

// kill SIGKILLs the demo and waits for it to be gone.
func (d *demoProc) kill(t *testing.T) {
	t.Helper()
	if err := d.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-d.done
}

// retryFinal retries POST /orders with key until the answer is final: it
// retries 409 (key in flight: the killed attempt's lease, or a charge in
// progress at the provider) and 5xx but the unknown-outcome ones, and returns
// the first other answer, or the last one after the deadline.
func retryFinal(t *testing.T, d *demoProc, key, body string, within time.Duration) httpAnswer {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
		final := a.Status < 500 && a.Status != 409 || a.code() == "payment_unknown"
		if final || time.Now().After(deadline) {
			return a
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// chargeIDOf returns the charge_id of a 201 order answer.
func chargeIDOf(t *testing.T, a httpAnswer) string {
	t.Helper()
	var o struct {
		ID       string `json:"id"`
		ChargeID string `json:"charge_id"`
	}
	if a.Status != 201 || json.Unmarshal(a.Body, &o) != nil || o.ID == "" {
		t.Fatalf("answer %d %s is not a created order", a.Status, a.Body)
	}
	return o.ChargeID
}

// keysOf returns the distinct Idempotency-Keys of calls.
func keysOf(calls []fakepay.Call) []string {
	seen := map[string]bool{}
	var out []string
	for _, c := range calls {
		if !seen[c.Key] {
			seen[c.Key] = true
			out = append(out, c.Key)
		}
	}
	return out
}

// checkOneChargeOneOrder checks the end state of cart after its key's final
// 201 answer a: exactly one charge at the provider, exactly one order, which
// carries that charge, and a carries it too; every call for the cart carried
// the same Idempotency-Key.
func checkOneChargeOneOrder(t *testing.T, db payDB, p *fakepay.Provider, cart string, a httpAnswer) {
	t.Helper()
	checkCharged(t, db, p, cart, a, 1)
}

// checkCharged is checkOneChargeOneOrder with keys distinct Idempotency-Keys
// among the cart's calls (2 after idem resolve --step --forget).
func checkCharged(t *testing.T, db payDB, p *fakepay.Provider, cart string, a httpAnswer, keys int) {
	t.Helper()
	charges := p.ChargesFor(cart)
	ords := db.orders(t, cart)
	if len(charges) != 1 {
		t.Fatalf("%d charges for %s, want exactly 1: %+v", len(charges), cart, charges)
	}
	if len(ords) != 1 {
		t.Fatalf("%d orders for %s, want exactly 1: %v", len(ords), cart, ords)
	}
	for _, charge := range ords {
		if charge != charges[0].ID {
			t.Fatalf("the order carries charge %q, the provider made %q", charge, charges[0].ID)
		}
	}
	if got := chargeIDOf(t, a); got != charges[0].ID {
		t.Fatalf("the final 201 carries charge_id %q, the provider made %q", got, charges[0].ID)
	}
	if got := keysOf(p.CallsFor(cart)); len(got) != keys {
		t.Fatalf("the calls for %s carried %d different Idempotency-Keys %q, want %d (the step's derived key)", cart, len(got), got, keys)
	}
}

// TestDemoPayment: the charge of a new order, its answers and its replays.
func TestDemoPayment(t *testing.T) {
	t.Parallel()
	payStores(t, func(t *testing.T, db payDB) {
		p := fakepay.Start(fakepay.HonoursKeys)
		t.Cleanup(p.Close)
		d := startPayDemo(t, db, p, "--payment-timeout", "1s")

		// A new order is charged once, carries the charge, and is replayed.
		a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-ok", payOrder("c_ok"))
		checkOneChargeOneOrder(t, db, p, "c_ok", a)
		if r := sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-ok", payOrder("c_ok")); !r.replayed() || string(r.Body) != string(a.Body) {
			t.Fatalf("retry: %d replayed=%v %s, want the stored 201", r.Status, r.replayed(), r.Body)
		}
		if n := len(p.CallsFor("c_ok")); n != 1 {
			t.Fatalf("the provider saw %d calls, want 1", n)
		}
		call := p.CallsFor("c_ok")[0]
		if !strings.HasPrefix(call.Key, "idem_") || strings.Contains(call.Key, "pay-ok") {
			t.Fatalf("Idempotency-Key sent to the provider: %q, want a derived key (idem_…, not the client's)", call.Key)
		}
		if call.Body != `{"amount_cents":1900,"cart_id":"c_ok"}` {
			t.Fatalf("charge body %s", call.Body)
		}

		// A decline: 402, stored, replayed without a second call, no order.
		p.FailNext(402)
		a = sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-declined", payOrder("c_declined"))
		if a.Status != 402 || a.code() != "payment_failed" {
			t.Fatalf("declined: %d %s, want 402 payment_failed", a.Status, a.Body)
		}
		r := sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-declined", payOrder("c_declined"))
		if r.Status != 402 || !r.replayed() {
			t.Fatalf("retry of the declined order: %d replayed=%v %s, want the stored 402", r.Status, r.replayed(), r.Body)
		}
		if n := len(p.CallsFor("c_declined")); n != 1 {
			t.Fatalf("the provider saw %d calls for the declined order, want 1", n)
		}
		if n := len(db.orders(t, "c_declined")); n != 0 {
			t.Fatalf("%d orders for a declined payment", n)
		}

		// A 5xx: 502, nothing stored, and the retry charges with the same key.
		p.FailNext(503)
		a = sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-5xx", payOrder("c_5xx"))
		if a.Status != 502 || a.code() != "payment_unavailable" || a.replayed() {
			t.Fatalf("provider 503: %d %s, want 502 payment_unavailable", a.Status, a.Body)
		}
		a = sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-5xx", payOrder("c_5xx"))
		if a.replayed() {
			t.Fatalf("the 502 was stored and replayed")
		}
		checkOneChargeOneOrder(t, db, p, "c_5xx", a)

		// A timeout: the provider charged but answered too late; the retry
		// asks again with the same key and gets the same charge.
		p.SetDelay(3 * time.Second)
		a = sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-slow", payOrder("c_slow"))
		p.SetDelay(0)
		if a.Status != 502 || a.code() != "payment_unavailable" {
			t.Fatalf("provider slower than --payment-timeout: %d %s, want 502 payment_unavailable", a.Status, a.Body)
		}
		a = retryFinal(t, d, "pay-slow", payOrder("c_slow"), 30*time.Second)
		checkOneChargeOneOrder(t, db, p, "c_slow", a)

		// GET shows the charge.
		got := sendHTTP(t, "GET", d.URL+"/orders?cart_id=c_ok", "t1", "-", "")
		if !strings.Contains(string(got.Body), `"charge_id":"`+p.ChargesFor("c_ok")[0].ID+`"`) {
			t.Fatalf("GET /orders: %s lacks the charge_id", got.Body)
		}
	}, payOpener{"mysql", mysqlPayDB})
}

// TestDemoPaymentUnreachable: a provider that does not answer at all is a 502,
// and nothing is stored.
func TestDemoPaymentUnreachable(t *testing.T) {
	t.Parallel()
	db := sqlitePayDB(t)
	d := startDemo(t, db.dir, nil, "--db", db.db, "--payment-url", "http://127.0.0.1:9", "--metrics-addr", "")
	for range 2 {
		a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "pay-down", payOrder("c_down"))
		if a.Status != 502 || a.code() != "payment_unavailable" || a.replayed() {
			t.Fatalf("unreachable provider: %d replayed=%v %s, want 502 payment_unavailable, not stored", a.Status, a.replayed(), a.Body)
		}
	}
	if n := len(db.orders(t, "c_down")); n != 0 {
		t.Fatalf("%d orders without a payment", n)
	}
}

// TestDemoPaymentNoKey: with --require-key=false a POST without a key is
// charged too, unprotected (a retry is a new order and a new charge); a keyed
// one is still a step.
func TestDemoPaymentNoKey(t *testing.T) {
	t.Parallel()
	db := sqlitePayDB(t)
	p := fakepay.Start(fakepay.HonoursKeys)
	t.Cleanup(p.Close)
	d := startPayDemo(t, db, p, "--require-key=false")
	for range 2 {
		a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "-", payOrder("c_nokey"))
		if a.Status != 201 || chargeIDOf(t, a) == "" {
			t.Fatalf("POST without a key: %d %s, want 201 with a charge_id", a.Status, a.Body)
		}
	}
	if c, o := len(p.ChargesFor("c_nokey")), len(db.orders(t, "c_nokey")); c != 2 || o != 2 {
		t.Fatalf("%d charges and %d orders for two unkeyed POSTs, want 2 and 2", c, o)
	}
	p.FailNext(402)
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "-", payOrder("c_nokey_declined")); a.Status != 402 || a.code() != "payment_failed" {
		t.Fatalf("declined without a key: %d %s", a.Status, a.Body)
	}
	a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "keyed-"+cliRandHex(4), payOrder("c_keyed"))
	checkOneChargeOneOrder(t, db, p, "c_keyed", a)
}
