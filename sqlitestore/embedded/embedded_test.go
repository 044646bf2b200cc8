package embedded_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/sqlitestore/embedded"
)

func TestOpenSettings(t *testing.T) {
	t.Parallel()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "odd ?#% name.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for pragma, want := range map[string]string{
		"journal_mode": "wal",
		"busy_timeout": fmt.Sprint(embedded.BusyTimeout.Milliseconds()),
		"synchronous":  "1", // NORMAL
		"foreign_keys": "1",
	} {
		var got string
		if err := db.QueryRow("PRAGMA " + pragma).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if !strings.EqualFold(got, want) {
			t.Errorf("PRAGMA %s = %q, want %q", pragma, got, want)
		}
	}
	if got := db.Stats().MaxOpenConnections; got != embedded.MaxOpenConns {
		t.Errorf("MaxOpenConnections = %d, want %d", got, embedded.MaxOpenConns)
	}
}

// BEGIN is IMMEDIATE: a second transaction waits for the first one's write lock
// (up to the busy timeout) as soon as it begins, instead of failing with
// SQLITE_BUSY later when it first writes.
func TestBeginImmediate(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "x.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE t (v INTEGER)`); err != nil {
		t.Fatal(err)
	}
	tx1, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		began time.Time
		err   error
	}
	second := make(chan result, 1)
	go func() {
		tx2, err := db.Begin() // waits until tx1 ends
		began := time.Now()
		if err == nil {
			if _, err = tx2.Exec(`INSERT INTO t VALUES (2)`); err == nil {
				err = tx2.Commit()
			}
		}
		second <- result{began, err}
	}()
	time.Sleep(300 * time.Millisecond)
	ended := time.Now()
	if _, err := tx1.Exec(`INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	res := <-second
	if res.err != nil {
		t.Fatalf("second transaction: %v", res.err)
	}
	if res.began.Before(ended) {
		t.Fatalf("a second BEGIN returned while the first transaction held the write lock: BEGIN is not IMMEDIATE")
	}
	var n int
	if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM t`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("rows = %d, %v; want both transactions committed", n, err)
	}
}

// Processes starting together on a new file all open it: converting a new file
// to WAL takes a lock SQLite does not wait for, and Open retries.
func TestOpenConcurrently(t *testing.T) {
	t.Parallel()
	for round := range 5 {
		path := filepath.Join(t.TempDir(), fmt.Sprintf("new-%d.db", round))
		errs := make(chan error, 12)
		for range cap(errs) {
			go func() {
				db, err := embedded.Open(path) // a handle each, like separate processes
				if err == nil {
					err = db.Close()
				}
				errs <- err
			}()
		}
		for range cap(errs) {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
	}
}

func TestOpenRefusesMemory(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"", ":memory:", "file::memory:?cache=shared"} {
		if db, err := embedded.Open(p); err == nil {
			db.Close()
			t.Errorf("Open(%q) succeeded, want an error", p)
		}
	}
}

func ExampleOpen() {
	dir, err := os.MkdirTemp("", "embedded-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := embedded.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	var mode string
	_ = db.QueryRow("PRAGMA journal_mode").Scan(&mode)
	fmt.Println(mode)
	// Output: wal
}
