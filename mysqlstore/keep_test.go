package mysqlstore

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
)

// TestKeepNeverWaitsForABusyConnection: two goroutines that prepared the same
// statement at once keep the first, and the second closes its copy. Closing
// waits for the connection the copy was prepared on to finish its statement;
// done under the store's mutex (or before returning), it made every
// statement lookup wait for that connection, whose statement waited for a
// row lock held by a transaction whose goroutine was one of those lookups:
// concurrent BeginSteps of one step stood still until
// innodb_lock_wait_timeout (TestStepStoreTxPath/ConcurrentBegin failed 3 runs
// in 15 with Error 1205).
func TestKeepNeverWaitsForABusyConnection(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1) // both copies on the one connection
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	const q = "SELECT 1"
	first, err := db.PrepareContext(ctx, q)
	if err != nil {
		t.Fatalf("prepare: %v (is MySQL/MariaDB reachable? set IDEM_TEST_MYSQL_URL)", err)
	}
	dup, err := db.PrepareContext(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.keep(q, first); got != first {
		t.Fatal("keep of the first copy returned another")
	}

	busy := make(chan error, 1)
	go func() {
		_, err := db.ExecContext(ctx, "DO SLEEP(5)")
		busy <- err
	}()
	for db.Stats().InUse == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // the connection is in its statement

	kept := make(chan *sql.Stmt, 1)
	go func() { kept <- s.keep(q, dup) }()
	select {
	case got := <-kept:
		if got != first {
			t.Fatal("keep of the second copy did not return the first")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("keep of a duplicate waited for the busy connection its copy was prepared on")
	}
	looked := make(chan *sql.Stmt, 1)
	go func() { looked <- s.cached(q) }()
	select {
	case got := <-looked:
		if got != first {
			t.Fatal("the cached statement is not the first copy")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a statement lookup waited for the busy connection")
	}
	if err := <-busy; err != nil {
		t.Fatal(err)
	}
}
