package main

import (
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestGCAndInspect creates records through the demo, inspects one, lets them
// expire, and collects them with idem gc in batches of one.
func TestGCAndInspect(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	db := "sqlite:" + filepath.Join(dir, "idem-demo.db")
	const ttl = 6 * time.Second // long enough for inspect and the first gc on a loaded machine
	d := startDemo(t, dir, nil, "--ttl", ttl.String(), "--lease", "1s")
	keys := []string{"gc-a-" + cliRandHex(4), "gc-b-" + cliRandHex(4), "gc-c-" + cliRandHex(4)}
	var created httpAnswer
	for _, k := range keys {
		created = sendHTTP(t, "POST", d.URL+"/orders", "t1", k, `{"cart_id":"c_gc","total_cents":1900}`)
		if created.Status != 201 {
			t.Fatalf("POST: %d %s", created.Status, created.Body)
		}
	}
	o := created.order(t)
	expired := time.Now().Add(ttl + time.Second)

	code, out, stderr := runIdem(t, dir, nil, "inspect", "--db", db, "--scope", "t1", "--body", keys[2])
	for _, want := range []string{
		`scope:       "t1"`, `key:         "` + keys[2] + `"`, "state:       complete", "age:", "lease:       none (complete)",
		"expires in:", "fingerprint: v3:", "status:      201", "Content-Type: application/json",
		"Location: /orders/" + o.ID, "body:        " + strconv.Itoa(len(created.Body)) + " bytes", "ref:         " + o.ID,
		"answered with this stored 201", strings.TrimSpace(string(created.Body)),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect output lacks %q", want)
		}
	}
	if code != 0 {
		t.Errorf("inspect: exit %d", code)
	}
	if t.Failed() {
		t.Fatalf("inspect output:\n%s%s", out, stderr)
	}
	// Flags after the key work too; another scope has no record.
	if code, out, _ := runIdem(t, dir, nil, "inspect", keys[0], "--db", db, "--scope", "t2"); code != 1 || !strings.HasPrefix(out, "no record for key") {
		t.Fatalf("inspect in scope t2: exit %d\n%s", code, out)
	}

	d.stop(t) // its janitor must not race gc
	code, out, _ = runIdem(t, dir, nil, "gc", "--db", db)
	if code != 0 || !strings.Contains(out, "deleted 0 expired key records") {
		t.Fatalf("gc before expiry: exit %d\n%s", code, out)
	}
	time.Sleep(time.Until(expired))
	code, out, stderr = runIdem(t, dir, nil, "gc", "--db", db, "--batch", "1")
	if code != 0 || !strings.Contains(out, "deleted 3 expired key records (table idem_records of "+db+")") {
		t.Fatalf("gc after expiry: exit %d\n%s%s", code, out, stderr)
	}
	code, out, _ = runIdem(t, dir, []string{"IDEM_DB=" + db}, "gc")
	if code != 0 || !strings.Contains(out, "deleted 0 expired key records") {
		t.Fatalf("second gc: exit %d\n%s", code, out)
	}
	code, out, _ = runIdem(t, dir, nil, "inspect", "--db", db, "--scope", "t1", keys[2])
	if code != 1 || !strings.Contains(out, "no record for key") {
		t.Fatalf("inspect after gc: exit %d\n%s", code, out)
	}
	if n := countSQLite(t, filepath.Join(dir, "idem-demo.db"), "c_gc"); n != 3 {
		t.Fatalf("gc touched the orders: %d left, want 3", n)
	}
}

func TestGCUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if code, out, _ := runIdem(t, dir, nil, "gc", "--help"); code != 0 || !strings.Contains(out, "Example:") || !strings.Contains(out, "--batch") {
		t.Fatalf("gc --help: exit %d\n%s", code, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"gc"}, "--db is required"},
		{[]string{"gc", "--db", "sqlite:x.db", "--batch", "0"}, "--batch 0 is too small"},
		{[]string{"gc", "--db", "sqlite:x.db", "--batch", "many"}, `invalid value "many" for --batch; use a whole number`},
	} {
		if code, _, stderr := runIdem(t, dir, nil, c.args...); code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, stderr, c.want)
		}
	}
	// gc on a database without the table fails and says to migrate.
	code, _, stderr := runIdem(t, dir, nil, "gc", "--db", "sqlite:"+filepath.Join(dir, "empty.db"))
	if code != 1 || !strings.Contains(stderr, "idem migrate") {
		t.Errorf("gc without a table: exit %d, stderr %q", code, stderr)
	}
}

// TestGCFailurePrefixedOnce: a sweep that fails says "idem gc: janitor …", not
// "idem gc: idem: janitor …".
func TestGCFailurePrefixedOnce(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:app.db"); code != exitOK {
		t.Fatalf("migrate: exit %d %s%s", code, out, stderr)
	}
	code, _, stderr := runIdem(t, dir, nil, "gc", "--db", "sqlite:app.db", "--table", "nosuch")
	if code != exitFailure || !strings.HasPrefix(stderr, "idem gc: janitor deleted 0 records, then: ") || strings.Contains(stderr, "idem gc: idem:") {
		t.Fatalf("gc of a missing table: exit %d, stderr %q; want 1 and one prefix", code, stderr)
	}
}
