package mysqlstore_test

import (
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// countersTable creates a table with rows 1 and 2, dropped at the end.
func countersTable(t testing.TB, db *sql.DB) string {
	t.Helper()
	name := randomName("counters_")
	dropAtEnd(t, db, name)
	ctx := ctxFor(t)
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+name+"` (id INT NOT NULL PRIMARY KEY, n INT NOT NULL) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "INSERT INTO `"+name+"` VALUES (1, 0), (2, 0)"); err != nil {
		t.Fatal(err)
	}
	return name
}

// deadlock makes InnoDB roll back tx as a deadlock victim, for real: tx updates
// counter 1, a heavier transaction (it inserted many rows first, so InnoDB picks
// the lighter tx as the victim) updates counter 2, then each updates the other's
// row. It returns the error tx got, which the caller checks is 1213.
func deadlock(t *testing.T, db *sql.DB, tx mysqlstore.Querier, counters string) error {
	t.Helper()
	ctx := ctxFor(t)
	upd := "UPDATE `" + counters + "` SET n = n + 1 WHERE id = ?"
	if _, err := tx.ExecContext(ctx, upd, 1); err != nil {
		t.Fatalf("tx: locking counter 1: %v", err)
	}
	other, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback()
	var vals []string
	for i := 100; i < 400; i++ {
		vals = append(vals, fmt.Sprintf("(%d, 0)", i))
	}
	if _, err := other.ExecContext(ctx, "INSERT INTO `"+counters+"` VALUES "+strings.Join(vals, ", ")); err != nil {
		t.Fatal(err)
	}
	if _, err := other.ExecContext(ctx, upd, 2); err != nil {
		t.Fatal(err)
	}
	victim := make(chan error, 1)
	go func() { _, err := tx.ExecContext(ctx, upd, 2); victim <- err }()
	time.Sleep(100 * time.Millisecond) // usually lets tx wait first; either order deadlocks
	if _, err := other.ExecContext(ctx, upd, 1); err != nil {
		t.Fatalf("the heavier transaction was picked as the deadlock victim (%v); the test could not set up the case", err)
	}
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	err = <-victim
	if err == nil || !strings.Contains(err.Error(), "1213") {
		t.Fatalf("tx's conflicting update = %v, want a deadlock (1213)", err)
	}
	return err
}

func countAll(t testing.TB, db *sql.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(ctxFor(t), "SELECT COUNT(*) FROM `"+table+"`").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// When InnoDB rolls the handler's transaction back as a deadlock victim, nothing
// the handler wrote commits — not before the deadlock, not the statements it sends
// after ignoring the error — and neither does the completion: Complete (or a
// Commit without Complete) reports idem.ErrTxAborted. Found: the later statements
// and the completion autocommitted, storing a 201 while no order existed.
// TestDeadlockVictimCommitsNothing runs testDeadlockVictimCommitsNothing with and without multiStatements (see bothModes).
func TestDeadlockVictimCommitsNothing(t *testing.T) { bothModes(t, testDeadlockVictimCommitsNothing) }

func testDeadlockVictimCommitsNothing(t *testing.T) {
	for _, mode := range []string{"complete", "commit only", "single tx"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			// One connection: the pool hands the transaction's connection back
			// afterwards, which proves its session is usable (not left read-only).
			db := openDB(t, 1, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			counters := countersTable(t, openDB(t, 2, ""))
			other := openDB(t, 2, "")
			ctx := ctxFor(t)
			now := time.Now()
			req := claimReq("tenant", "dl", "v1:dl", now)
			resp := &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}

			var (
				htx    *sql.Tx
				finish func() (completeErr, commitErr error)
			)
			if mode == "single tx" {
				tctx, ltx, rec, err := s.BeginLocked(ctx, req.Scope, req.Key, now)
				if err != nil || rec != nil {
					t.Fatalf("BeginLocked = %v, %v", rec, err)
				}
				htx = mysqlstore.Tx(tctx)
				finish = func() (error, error) {
					rec := completeRecord(req.Scope, req.Key, now, `{"id":1}`)
					ierr := ltx.Insert(ctx, rec)
					var cerr error
					if ierr == nil {
						cerr = ltx.Commit(ctx)
					}
					_ = ltx.Rollback(ctx)
					return ierr, cerr
				}
			} else {
				if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
				tctx, tx, err := s.BeginTx(ctx)
				if err != nil {
					t.Fatal(err)
				}
				htx = mysqlstore.Tx(tctx)
				finish = func() (error, error) {
					var err error
					if mode == "complete" {
						err = tx.Complete(ctx, req.Scope, req.Key, req.Token, resp, now, now.Add(time.Hour))
					}
					var cerr error
					if err == nil {
						cerr = tx.Commit(ctx)
					}
					_ = tx.Rollback(ctx)
					return err, cerr
				}
			}
			if _, err := htx.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('before')"); err != nil {
				t.Fatal(err)
			}
			_ = deadlock(t, other, htx, counters)
			// The handler ignores the error (a best-effort counter) and goes on.
			_, afterErr := htx.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('after')")
			completeErr, commitErr := finish()
			t.Logf("after the deadlock: handler's insert: %v; completion: %v; commit: %v", afterErr, completeErr, commitErr)

			if err := errors.Join(completeErr, commitErr); !errors.Is(err, idem.ErrTxAborted) {
				t.Errorf("completion and commit after the deadlock = %v, want idem.ErrTxAborted", err)
			}
			if n := countAll(t, other, orders); n != 0 {
				t.Errorf("%d orders committed from a transaction InnoDB rolled back, want 0", n)
			}
			rec, err := s.Get(ctx, req.Scope, req.Key, now)
			switch {
			case mode == "single tx" && !errors.Is(err, idem.ErrNotFound):
				t.Errorf("record after the aborted single transaction = %+v, %v; want none", rec, err)
			case mode != "single tx" && (err != nil || rec.State != idem.StateInFlight):
				t.Errorf("record after the aborted transaction = %+v, %v; want still in flight", rec, err)
			}
			// The connection went back to the pool with its session restored.
			if _, err := db.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('later')"); err != nil {
				t.Errorf("a write on the pooled connection afterwards: %v", err)
			}
			if n := countAll(t, other, orders); n != 1 {
				t.Errorf("a write on the pooled connection afterwards: %d orders visible elsewhere, want 1 (autocommit left off?)", n)
			}
		})
	}
}

// A transaction that ends normally leaves its connection writable for the rest
// of the application, after Commit and after Rollback.
// TestSessionRestoredAfterTx runs testSessionRestoredAfterTx with and without multiStatements (see bothModes).
func TestSessionRestoredAfterTx(t *testing.T) { bothModes(t, testSessionRestoredAfterTx) }

func testSessionRestoredAfterTx(t *testing.T) {
	db := openDB(t, 1, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	ctx := ctxFor(t)
	for _, commit := range []bool{true, false} {
		tctx, tx, err := s.BeginTx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := mysqlstore.Tx(tctx).ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('in')"); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('out')"); err != nil {
			t.Fatalf("commit=%v: a write on the pooled connection afterwards: %v", commit, err)
		}
		var autocommit int
		if err := db.QueryRowContext(ctx, "SELECT @@autocommit").Scan(&autocommit); err != nil || autocommit != 1 {
			t.Fatalf("commit=%v: @@autocommit = %d, %v", commit, autocommit, err)
		}
	}
	if n := countAll(t, openDB(t, 1, ""), orders); n != 3 {
		t.Fatalf("%d orders, want 3 (one committed in the transaction, two outside)", n)
	}
}

// Through the middleware: the handler inserts an order, a best-effort counter
// update deadlocks, the handler ignores it and answers 201. That 201 must not be
// stored (0 orders exist), and a retry runs afresh and creates the one order.
// TestDeadlockThroughMiddleware runs testDeadlockThroughMiddleware with and without multiStatements (see bothModes).
func TestDeadlockThroughMiddleware(t *testing.T) { bothModes(t, testDeadlockThroughMiddleware) }

func testDeadlockThroughMiddleware(t *testing.T) {
	db := openDB(t, 8, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	counters := countersTable(t, db)
	other := openDB(t, 2, "")
	var first atomic.Bool
	first.Store(true)
	srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := mysqlstore.Tx(r.Context())
		res, err := tx.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('o')")
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if first.Swap(false) {
			_ = deadlock(t, other, tx, counters) // ignored by the handler
		}
		id, _ := res.LastInsertId()
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}))
	key := randomName("key-")
	post := func() (int, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b strings.Builder
		_, _ = fmt.Fprint(&b, resp.Header.Get("Idempotent-Replayed"))
		return resp.StatusCode, b.String()
	}
	st, replayed := post()
	t.Logf("first answer: %d (replayed %q)", st, replayed)
	if st == http.StatusCreated {
		t.Errorf("the deadlocked request was answered 201 although its order was rolled back")
	}
	if n := countAll(t, db, orders); n != 0 {
		t.Fatalf("%d orders after the deadlocked request, want 0", n)
	}
	st, replayed = post()
	if st != http.StatusCreated || replayed != "" {
		t.Fatalf("retry = %d (replayed %q), want a fresh 201", st, replayed)
	}
	if n := countAll(t, db, orders); n != 1 {
		t.Fatalf("%d orders after the retry, want 1", n)
	}
}

// The connection of the handler's transaction dies (killed on the server) before
// the completion, or the completion is larger than max_allowed_packet: the
// completion fails, nothing commits, the record stays in flight, and the pool
// goes on working.
// TestCompletionFailsCommitsNothing runs testCompletionFailsCommitsNothing with and without multiStatements (see bothModes).
func TestCompletionFailsCommitsNothing(t *testing.T) { bothModes(t, testCompletionFailsCommitsNothing) }

func testCompletionFailsCommitsNothing(t *testing.T) {
	for _, mode := range []string{"killed connection", "packet too large"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 1, "")
			other := openDB(t, 2, "")
			s := newStore(t, db)
			orders := ordersTable(t, other)
			ctx := ctxFor(t)
			now := time.Now()
			req := claimReq("tenant", "k", "v1:k", now)
			if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			tctx, tx, err := s.BeginTx(ctx)
			if err != nil {
				t.Fatal(err)
			}
			htx := mysqlstore.Tx(tctx)
			if _, err := htx.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('x')"); err != nil {
				t.Fatal(err)
			}
			resp := &idem.Response{Status: 201, Body: []byte("ok")}
			if mode == "killed connection" {
				var id int64
				if err := htx.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id); err != nil {
					t.Fatal(err)
				}
				if _, err := other.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
					t.Fatal(err)
				}
			} else {
				var max int
				if err := other.QueryRowContext(ctx, "SELECT @@max_allowed_packet").Scan(&max); err != nil {
					t.Fatal(err)
				}
				if max > 64<<20 {
					t.Skipf("max_allowed_packet is %d bytes; too large to exceed in a test", max)
				}
				resp.Body = make([]byte, max+1)
			}
			err = tx.Complete(ctx, req.Scope, req.Key, req.Token, resp, now, now.Add(time.Hour))
			if err == nil {
				err = tx.Commit(ctx)
			}
			_ = tx.Rollback(ctx)
			if err == nil || errors.Is(err, idem.ErrLockLost) {
				t.Fatalf("completion = %v, want a store error", err)
			}
			t.Logf("completion: %.200v", err)
			if n := countAll(t, other, orders); n != 0 {
				t.Errorf("%d orders committed, want 0", n)
			}
			if rec, err := s.Get(ctx, req.Scope, req.Key, now); err != nil || rec.State != idem.StateInFlight {
				t.Errorf("record = %+v, %v; want in flight", rec, err)
			}
			// The one-connection pool works again, with autocommit on.
			if _, err := db.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('later')"); err != nil {
				t.Fatalf("the pool after the failure: %v", err)
			}
			if n := countAll(t, other, orders); n != 1 {
				t.Errorf("%d orders visible after a write on the pool, want 1", n)
			}
		})
	}
}
