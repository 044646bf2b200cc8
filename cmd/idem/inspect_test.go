package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestInspectInFlight inspects a key while its request sleeps in the handler.
func TestInspectInFlight(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--handler-delay", "4s")
	key := "flight-" + cliRandHex(4)
	done := make(chan httpAnswer, 1)
	go func() { done <- sendHTTP(t, "POST", d.URL+"/orders", "t1", key, `{"cart_id":"c_fl","total_cents":1}`) }()
	db := "sqlite:" + filepath.Join(dir, "idem-demo.db")
	var out string
	deadline := time.Now().Add(3 * time.Second)
	for {
		var code int
		code, out, _ = runIdem(t, dir, nil, "inspect", "--db", db, "--scope", "t1", key)
		if code == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, want := range []string{"state:       in_flight", "left (until", "a retry gets 409"} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect while in flight lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "status:") {
		t.Errorf("an in-flight record shows a stored status:\n%s", out)
	}
	if a := <-done; a.Status != 201 {
		t.Fatalf("POST: %d %s", a.Status, a.Body)
	}
}

func TestInspectUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if code, out, _ := runIdem(t, dir, nil, "inspect", "--help"); code != 0 || !strings.Contains(out, "Example:") || !strings.Contains(out, "--scope") {
		t.Fatalf("inspect --help: exit %d\n%s", code, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"inspect", "--db", "sqlite:x.db"}, "give exactly one KEY (got 0 arguments)"},
		{[]string{"inspect", "--db", "sqlite:x.db", "a", "b"}, "give exactly one KEY (got 2 arguments)"},
		{[]string{"inspect", "k"}, "--db is required"},
		{[]string{"inspect", "--db", "sqlite:x.db", "bad key"}, "invalid idempotency key"},
		{[]string{"inspect", "--db", "mysql://root@127.0.0.1", "k"}, "name the server and the database"},
	} {
		if code, _, stderr := runIdem(t, dir, nil, c.args...); code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, stderr, c.want)
		}
	}
}
