package main

import (
	"context"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestDemoTwoProcessesSQLite runs two demo processes on one SQLite file (the
// README's default store, started twice): 60 requests with one key, spread
// over both from one barrier, make exactly one order, and every 201 is that
// order. Then a third process is killed (SIGKILL) while it holds a second key
// inside its transaction: another process's request for that key executes
// it once (the key is not stuck, the dead one's insert is gone), and the first
// process replays it.
func TestDemoTwoProcessesSQLite(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	db := "sqlite:" + filepath.Join(dir, "shared.db")
	a := startDemo(t, dir, nil, "--db", db, "--handler-delay", "300ms")
	b := startDemo(t, dir, nil, "--db", db, "--handler-delay", "300ms")

	const n = 60
	body := []byte(`{"cart_id":"c_two","total_cents":1900}`)
	urls := [2]string{a.URL + "/orders", b.URL + "/orders"}
	key := "two-" + cliRandHex(8)
	raceOneKey(t, urls, n, key, body, func() string { return "\ndemo a:\n" + a.output() + "\ndemo b:\n" + b.output() })
	if got := countSQLite(t, filepath.Join(dir, "shared.db"), "c_two"); got != 1 {
		t.Fatalf("%d orders for the cart, want 1", got)
	}

	// A third process holds key2 in its transaction for a minute, and dies.
	c := startDemo(t, dir, nil, "--db", db, "--handler-delay", "1m")
	key2, body2 := "kill-"+cliRandHex(8), `{"cart_id":"c_killed","total_cents":1}`
	go func() {
		req, _ := http.NewRequest("POST", c.URL+"/orders", strings.NewReader(body2))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", key2)
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	// c is inside its transaction once the file's write lock is taken (a and
	// b are idle). b's request for key2 waits for that lock (another process's
	// key is not known to b: sqlitestore's doc) and c dies meanwhile, or just
	// before: either way b finds no record and executes it, once.
	waitWriteLocked(t, filepath.Join(dir, "shared.db"), c)
	answer := make(chan httpAnswer, 1)
	go func() {
		req, _ := http.NewRequest("POST", b.URL+"/orders", strings.NewReader(body2))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", key2)
		resp, err := (&http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err != nil {
			answer <- httpAnswer{Body: []byte(err.Error())}
			return
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		answer <- httpAnswer{resp.StatusCode, resp.Header, data}
	}()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-c.done
	r := <-answer
	if r.Status != 201 || r.replayed() {
		t.Fatalf("b's request while c was killed: %d replayed=%v %s, want an executed 201\ndemo b:\n%s", r.Status, r.replayed(), r.Body, b.output())
	}
	if again := sendHTTP(t, "POST", a.URL+"/orders", "t1", key2, body2); again.Status != 201 || !again.replayed() || string(again.Body) != string(r.Body) {
		t.Fatalf("retry on a: %d replayed=%v %s, want the replay of %s", again.Status, again.replayed(), again.Body, r.Body)
	}
	if got := countSQLite(t, filepath.Join(dir, "shared.db"), "c_killed"); got != 1 {
		t.Fatalf("%d orders for the killed request's cart, want 1", got)
	}
}

// waitWriteLocked waits (up to 30 s) until another connection holds the
// SQLite file's write lock: BEGIN IMMEDIATE without a busy timeout fails.
func waitWriteLocked(t *testing.T, path string, d *demoProc) {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "PRAGMA busy_timeout = 0"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
			return // locked by the demo's transaction
		}
		if _, err := conn.ExecContext(ctx, "ROLLBACK"); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no transaction took the write lock of %s in 30s\ndemo:\n%s", path, d.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
