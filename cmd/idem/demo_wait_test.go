package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/internal/testenv"
)

// TestDemoInFlightWait: two demo processes on one SQLite file with
// --in-flight-wait 10s and a handler that takes a second: 20 requests with one
// key, spread over both at one moment, make one order and every other request
// gets its replay — no 409 (without the flag, the duplicates get 409).
func TestDemoInFlightWait(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	db := "sqlite:" + filepath.Join(dir, "shared.db")
	a := startDemo(t, dir, nil, "--db", db, "--handler-delay", "1s", "--in-flight-wait", "10s")
	b := startDemo(t, dir, nil, "--db", db, "--handler-delay", "1s", "--in-flight-wait", "10s")
	waitAtTwoDemos(t, a, b, func(cart string) int { return countSQLite(t, filepath.Join(dir, "shared.db"), cart) })
}

// TestDemoInFlightWaitTwoProcesses: the same across two demo processes on one
// PostgreSQL database (woken by LISTEN/NOTIFY), one MariaDB database (polled),
// and with the keys in one Redis (pub/sub; the orders in one SQLite file).
func TestDemoInFlightWaitTwoProcesses(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		dbURL := newPostgresDatabase(t)
		dir := t.TempDir()
		a := startDemo(t, dir, nil, "--db", dbURL, "--handler-delay", "1s", "--in-flight-wait", "10s")
		b := startDemo(t, dir, nil, "--db", dbURL, "--handler-delay", "1s", "--in-flight-wait", "10s")
		pg := pgConnect(t, dbURL)
		waitAtTwoDemos(t, a, b, func(cart string) int {
			var n int
			if err := pg.QueryRow(context.Background(), "SELECT count(*) FROM orders WHERE cart_id = $1", cart).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		})
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		dbURL, db := newMySQLDatabase(t)
		dir := t.TempDir()
		a := startDemo(t, dir, nil, "--db", dbURL, "--handler-delay", "1s", "--in-flight-wait", "10s")
		b := startDemo(t, dir, nil, "--db", dbURL, "--handler-delay", "1s", "--in-flight-wait", "10s")
		waitAtTwoDemos(t, a, b, func(cart string) int {
			var n int
			if err := db.QueryRow("SELECT count(*) FROM orders WHERE cart_id = ?", cart).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		})
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		redisURL := testenv.RedisURL(t)
		prefix := "idem-waittest-" + cliRandHex(5) + ":"
		t.Cleanup(func() { deleteRedisPrefix(t, redisURL, prefix) })
		dir := t.TempDir()
		db := "sqlite:" + filepath.Join(dir, "orders.db")
		a := startDemo(t, dir, nil, "--db", db, "--keys", redisURL, "--table", prefix, "--handler-delay", "1s", "--in-flight-wait", "10s")
		b := startDemo(t, dir, nil, "--db", db, "--keys", redisURL, "--table", prefix, "--handler-delay", "1s", "--in-flight-wait", "10s")
		waitAtTwoDemos(t, a, b, func(cart string) int { return countSQLite(t, filepath.Join(dir, "orders.db"), cart) })
	})
}

// waitAtTwoDemos fires 20 requests with one key at two demos started with
// --in-flight-wait, spread over both at one moment: one executes, every other
// gets its byte-exact replay (no 409), and count(cart) finds one order.
func waitAtTwoDemos(t *testing.T, a, b *demoProc, count func(cart string) int) {
	t.Helper()
	const n = 20
	cart := "c_wait_" + cliRandHex(4)
	body := []byte(`{"cart_id":"` + cart + `","total_cents":1900}`)
	urls := [2]string{a.URL + "/orders", b.URL + "/orders"}
	key := "wait-" + cliRandHex(8)
	hdr := http.Header{"Authorization": {"Bearer t1"}}
	results := racetest.Fire(n, func(i int) (*http.Request, error) { return racetest.Post(urls[i%2], key, body, hdr)(i) })
	executed, replayed := 0, 0
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
		default:
			t.Fatalf("status %d: %s\ndemo a:\n%s\ndemo b:\n%s", r.Status, r.Body, a.output(), b.output())
		}
	}
	if executed != 1 || replayed != n-1 {
		t.Fatalf("%d executed, %d replayed, want 1 and %d", executed, replayed, n-1)
	}
	for _, r := range results {
		if string(r.Body) != string(created) {
			t.Fatalf("a replay differs from the executed answer:\n%s\n%s", r.Body, created)
		}
	}
	if got := count(cart); got != 1 {
		t.Fatalf("%d orders for the cart, want 1", got)
	}
}

// stripeLikeCall places one order the way stripe-go does: one key for the
// call, a retry 0.5–1 s after a network error or a 409 (Retry-After ignored),
// at most 2 retries. The first attempt's connection is lost after lose (the
// client hears nothing, the server goes on). It returns the final status.
func stripeLikeCall(url string, hdr http.Header, key string, body []byte, lose time.Duration) (int, error) {
	status := 0
	for attempt := 0; attempt < 3; attempt++ {
		if attempt > 0 {
			time.Sleep(500*time.Millisecond + time.Duration(rand.Int64N(int64(500*time.Millisecond))))
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if attempt == 0 {
			ctx, cancel = context.WithTimeout(context.Background(), lose)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			cancel()
			return 0, err
		}
		req.Header = hdr.Clone()
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err != nil {
			cancel()
			status = 0
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		cancel()
		status = resp.StatusCode
		if status != http.StatusConflict {
			return status, nil
		}
	}
	return status, nil
}

// TestStripeLikeClientThroughTheDemo: a client that retries like stripe-go
// (0.5–1 s apart, Retry-After ignored, gives up after 2 retries), whose first
// attempt is lost while a 2 s order runs, hears the order's 201 on every call
// with --in-flight-wait; without it, retries that come while the order runs get
// 409 and some calls end with it although the order was placed.
func TestStripeLikeClientThroughTheDemo(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--db", "sqlite:"+filepath.Join(dir, "demo.db"), "--handler-delay", "2s", "--in-flight-wait", "10s")
	const calls = 6
	hdr := http.Header{"Authorization": {"Bearer t1"}}
	var wg sync.WaitGroup
	statuses := make([]int, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := []byte(fmt.Sprintf(`{"cart_id":"c_stripe_%d","total_cents":1900}`, i))
			statuses[i], _ = stripeLikeCall(d.URL+"/orders", hdr, fmt.Sprintf("stripe-%s-%d", cliRandHex(4), i), body, 300*time.Millisecond)
		}()
	}
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusCreated {
			t.Errorf("call %d ended with %d, want 201 (the order was placed)", i, s)
		}
		if n := countSQLite(t, filepath.Join(dir, "demo.db"), fmt.Sprintf("c_stripe_%d", i)); n != 1 {
			t.Errorf("call %d: %d orders, want 1", i, n)
		}
	}
}

// TestStripeLikeClientThroughTheProxy: the same client through idem proxy
// --in-flight-wait in front of an upstream taking 2 s: every call hears the
// 201, and the upstream ran each order once.
func TestStripeLikeClientThroughTheProxy(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[string]int{}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		runs[string(b)]++
		mu.Unlock()
		time.Sleep(2 * time.Second)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	}))
	t.Cleanup(up.Close)
	p := startProxyProc(t, "--upstream", up.URL, "--db", "sqlite:"+filepath.Join(t.TempDir(), "keys.db"),
		"--route", "POST /orders", "--scope-header", "X-Tenant-ID", "--in-flight-wait", "10s")
	const calls = 6
	hdr := http.Header{"X-Tenant-ID": {"acme"}}
	var wg sync.WaitGroup
	statuses := make([]int, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := []byte(fmt.Sprintf(`{"cart_id":"c_%d"}`, i))
			statuses[i], _ = stripeLikeCall(p.URL+"/orders", hdr, fmt.Sprintf("stripe-proxy-%d", i), body, 300*time.Millisecond)
		}()
	}
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusCreated {
			t.Errorf("call %d ended with %d, want 201", i, s)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for body, n := range runs {
		if n != 1 {
			t.Errorf("%s ran %d times at the upstream, want 1", body, n)
		}
	}
	if len(runs) != calls {
		t.Errorf("%d orders reached the upstream, want %d", len(runs), calls)
	}
}
