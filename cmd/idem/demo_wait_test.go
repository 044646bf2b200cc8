package main

import (
	"net/http"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem/internal/racetest"
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
	const n = 20
	body := []byte(`{"cart_id":"c_wait","total_cents":1900}`)
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
	if got := countSQLite(t, filepath.Join(dir, "shared.db"), "c_wait"); got != 1 {
		t.Fatalf("%d orders for the cart, want 1", got)
	}
}
