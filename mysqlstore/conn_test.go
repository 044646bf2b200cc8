package mysqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// fastDSN is what the store's fast path needs: several statements per round
// trip, and the handler's parameters interpolated (one round trip for its
// statement).
const fastDSN = "&multiStatements=true&interpolateParams=true"

// postConn sends one POST with key and returns the status, whether it was a
// replay, and the body (status 0 and the error when no answer came).
func postConn(t *testing.T, url, key string) (int, bool, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/orders", strings.NewReader(`{"item":"x"}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, false, err.Error() // a handler's panic aborts the connection
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", string(b)
}

// recordCount is the number of records of key in s's table.
func recordCount(t *testing.T, db *sql.DB, s *mysqlstore.Store, key string) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(ctxFor(t), "SELECT COUNT(*) FROM `"+s.Table()+"` WHERE `key` = ?", key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// The failure paths of the transaction the store drives on the connection
// (mysqlstore.Conn, single-transaction flow, multiStatements): whatever goes
// wrong between the statements, the order and the stored answer commit
// together or not at all, the key's lock is freed (a retry runs at once), and
// the pool goes on working.
func TestConnFailurePaths(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// handler runs after the order's insert, on the handler's handle q;
		// other is a pool of its own.
		after func(t *testing.T, r *http.Request, q mysqlstore.Querier, other *sql.DB, counters string) (status int)
		// committed: the first request's order and answer are committed.
		committed bool
	}{
		{"failing statement answered 500", func(t *testing.T, r *http.Request, q mysqlstore.Querier, _ *sql.DB, _ string) int {
			if _, err := q.ExecContext(r.Context(), "INSERT INTO no_such_table_idem VALUES (1)"); err == nil {
				t.Error("the failing statement did not fail")
			}
			return http.StatusInternalServerError
		}, true}, // the handler's answer, stored with its order: both or neither
		{"failing statement then panic", func(t *testing.T, r *http.Request, q mysqlstore.Querier, _ *sql.DB, _ string) int {
			_, _ = q.ExecContext(r.Context(), "INSERT INTO no_such_table_idem VALUES (1)")
			panic(http.ErrAbortHandler)
		}, false},
		{"deadlock ignored", func(t *testing.T, r *http.Request, q mysqlstore.Querier, other *sql.DB, counters string) int {
			_ = deadlock(t, other, q, counters)
			// The handler goes on after the error: its next write opens a
			// new transaction in the session, which must not commit either.
			_, _ = q.ExecContext(r.Context(), "UPDATE `"+counters+"` SET n = n + 10 WHERE id = 1")
			return http.StatusCreated
		}, false},
		{"connection lost", func(t *testing.T, r *http.Request, q mysqlstore.Querier, other *sql.DB, _ string) int {
			var id int64
			if err := q.QueryRowContext(r.Context(), "SELECT CONNECTION_ID()").Scan(&id); err != nil {
				t.Fatal(err)
			}
			if _, err := other.ExecContext(r.Context(), fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
				t.Fatal(err)
			}
			return http.StatusCreated
		}, false},
		{"connection lost between business statements", func(t *testing.T, r *http.Request, q mysqlstore.Querier, other *sql.DB, counters string) int {
			var id int64
			if err := q.QueryRowContext(r.Context(), "SELECT CONNECTION_ID()").Scan(&id); err != nil {
				t.Fatal(err)
			}
			if _, err := other.ExecContext(r.Context(), fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
				t.Fatal(err)
			}
			if _, err := q.ExecContext(r.Context(), "UPDATE `"+counters+"` SET n = n + 10 WHERE id = 1"); err == nil {
				t.Error("a statement on the killed connection succeeded")
			}
			return http.StatusInternalServerError
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 4, fastDSN)
			other := openDB(t, 4, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			counters := countersTable(t, db)
			var first atomic.Bool
			first.Store(true)
			srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				q := mysqlstore.Conn(r.Context())
				if _, ok := q.(*sql.Tx); ok || q == nil {
					t.Errorf("Conn = %T, want the request's connection (the store's own transaction)", q)
				}
				if _, err := q.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES (?)", "o"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				status := http.StatusCreated
				if first.Swap(false) {
					status = tc.after(t, r, q, other, counters)
				}
				w.WriteHeader(status)
				fmt.Fprint(w, "done")
			}))
			key := randomName("key-")
			st, _, body := postConn(t, srv.URL, key)
			orders1, recs1 := countAll(t, other, orders), recordCount(t, other, s, key)
			t.Logf("first answer: %d %q; %d orders, %d records", st, body, orders1, recs1)
			if orders1 != recs1 {
				t.Fatalf("%d orders and %d records committed: the order and its answer must commit together", orders1, recs1)
			}
			if tc.committed != (orders1 == 1) {
				t.Fatalf("%d orders committed, want committed = %v", orders1, tc.committed)
			}
			var n int
			if err := other.QueryRowContext(ctxFor(t), "SELECT n FROM `"+counters+"` WHERE id = 1").Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n >= 10 {
				t.Errorf("counter 1 = %d: a write after the deadlock or the lost connection committed", n)
			}
			// The retry: a replay of what committed, else a fresh execution at
			// once (the lock was freed).
			st2, replayed, _ := postConn(t, srv.URL, key)
			switch {
			case tc.committed && (!replayed || st2 != st):
				t.Errorf("retry = %d (replayed %v), want the replay of %d", st2, replayed, st)
			case !tc.committed && (replayed || st2 != http.StatusCreated):
				t.Errorf("retry = %d (replayed %v), want a fresh 201", st2, replayed)
			}
			if n := countAll(t, other, orders); n != 1 {
				t.Errorf("%d orders after the retry, want 1", n)
			}
			// The pool works: more requests.
			for i := range 5 {
				if st, _, body := postConn(t, srv.URL, fmt.Sprintf("%s-%d", key, i)); st != http.StatusCreated {
					t.Errorf("later request: %d %s", st, body)
				}
			}
		})
	}
}

// Conn and Tx in one request: Tx first gives a *sql.Tx, and Conn then returns
// that same transaction; Conn first, and Tx returns nil (START TRANSACTION
// would commit what was written through Conn on its own).
func TestConnAndTx(t *testing.T) {
	t.Parallel()
	db := openDB(t, 4, fastDSN)
	other := openDB(t, 2, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	var order atomic.Value
	srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var q mysqlstore.Querier
		if order.Load() == "tx first" {
			tx := mysqlstore.Tx(ctx)
			if tx == nil {
				http.Error(w, "no Tx", 500)
				return
			}
			if q = mysqlstore.Conn(ctx); q != mysqlstore.Querier(tx) {
				t.Errorf("Conn after Tx = %T, want the same *sql.Tx", q)
			}
		} else {
			q = mysqlstore.Conn(ctx)
			if tx := mysqlstore.Tx(ctx); tx != nil {
				t.Errorf("Tx after Conn = %p, want nil", tx)
			}
		}
		if _, err := q.ExecContext(ctx, "INSERT INTO `"+orders+"` (item) VALUES ('o')"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for i, o := range []string{"tx first", "conn first", "tx first"} {
		order.Store(o)
		key := randomName("key-")
		if st, _, body := postConn(t, srv.URL, key); st != http.StatusCreated {
			t.Fatalf("%s: %d %s", o, st, body)
		}
		if st, replayed, _ := postConn(t, srv.URL, key); st != http.StatusCreated || !replayed {
			t.Errorf("%s: retry %d (replayed %v), want the replay", o, st, replayed)
		}
		if n := countAll(t, other, orders); n != i+1 {
			t.Errorf("%s: %d orders, want %d", o, n, i+1)
		}
	}
	// Outside a request there is neither.
	if mysqlstore.Conn(context.Background()) != nil || mysqlstore.Tx(context.Background()) != nil {
		t.Error("Conn or Tx outside a request is not nil")
	}
	_ = idem.ErrInFlight
	_ = time.Second
}

// A response too large to send as SQL text (over inlineLimit) is stored through
// a statement prepared on the request's connection, in the transaction the
// store drives there (Conn), and replays byte for byte.
func TestConnLargeResponse(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{fastDSN, "&multiStatements=true"} {
		t.Run(dsn, func(t *testing.T) {
			t.Parallel()
			testConnLargeResponse(t, dsn)
		})
	}
}

func testConnLargeResponse(t *testing.T, dsn string) {
	db := openDB(t, 4, dsn)
	other := openDB(t, 2, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	big := strings.Repeat("0123456789abcdef", 8<<10) // 128 KiB
	srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := mysqlstore.Conn(r.Context())
		if _, ok := q.(*sql.Tx); ok || q == nil {
			t.Errorf("Conn = %T, want the request's connection", q)
		}
		if _, err := q.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('o')"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, big)
	}))
	key := randomName("key-")
	if st, _, body := postConn(t, srv.URL, key); st != http.StatusCreated || body != big {
		t.Fatalf("first: %d, %d bytes", st, len(body))
	}
	st, replayed, body := postConn(t, srv.URL, key)
	if st != http.StatusCreated || !replayed || body != big {
		t.Fatalf("retry: %d replayed %v, %d bytes; want the replay of %d bytes", st, replayed, len(body), len(big))
	}
	if n := countAll(t, other, orders); n != 1 {
		t.Errorf("%d orders, want 1", n)
	}
}

// A statement the handler's goroutine sends through Conn after the request's
// transaction ended is refused (sql.ErrTxDone), whether the middleware
// committed or rolled back: it would otherwise run in autocommit on the
// connection before it goes back to the pool, and commit on its own.
func TestConnRefusedAfterTheEnd(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusCreated, 0} { // 0: the handler panics, the middleware rolls back
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 4, fastDSN)
			other := openDB(t, 2, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			late := make(chan error, 2)
			release := make(chan struct{})
			srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				q := mysqlstore.Conn(r.Context())
				if _, err := q.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('in')"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				go func() {
					<-release
					_, err := q.ExecContext(context.Background(), "INSERT INTO `"+orders+"` (item) VALUES ('late')")
					late <- err
					var n int
					late <- q.QueryRowContext(context.Background(), "SELECT 1").Scan(&n)
				}()
				if status == 0 {
					panic(http.ErrAbortHandler)
				}
				w.WriteHeader(status)
			}))
			postConn(t, srv.URL, randomName("key-"))
			close(release)
			if err := <-late; !errors.Is(err, sql.ErrTxDone) {
				t.Errorf("Exec after the end = %v, want sql.ErrTxDone", err)
			}
			if err := <-late; err == nil {
				t.Error("QueryRow after the end succeeded")
			}
			var lateRows int
			if err := other.QueryRowContext(ctxFor(t), "SELECT COUNT(*) FROM `"+orders+"` WHERE item = 'late'").Scan(&lateRows); err != nil {
				t.Fatal(err)
			}
			if n := countAll(t, other, orders); lateRows != 0 || (status != 0) != (n == 1) {
				t.Errorf("%d orders, %d of them late; want none late, and the request's own committed only with its answer", n, lateRows)
			}
		})
	}
}
