package mysqlstore_test

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// postItem sends one POST of item with key on a fresh connection and returns
// the status, whether it was a replay, and the body.
func postItem(url, key, item string) (int, bool, string) {
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	req, _ := http.NewRequest(http.MethodPost, url+"/orders", strings.NewReader(`{"item":"`+item+`"}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return 0, false, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get(idem.ReplayedHeader) == "true", string(b)
}

var idleFlows = []struct {
	name string
	flow idem.Flow
}{
	{"ClaimComplete", idem.FlowClaimComplete},
	{"SingleTx", idem.FlowSingleTx},
}

// TestWaitTimeoutClosesIdleConns: the server closes the pool's connections
// that sat idle past the session's wait_timeout (go-sql-driver passes the DSN
// parameter as a session variable), with the store's prepared statements on
// them. The requests that come after must all execute once and replay.
func TestWaitTimeoutClosesIdleConns(t *testing.T) { bothModes(t, testWaitTimeoutClosesIdleConns) }

func testWaitTimeoutClosesIdleConns(t *testing.T) {
	for _, f := range idleFlows {
		t.Run(f.name, func(t *testing.T) {
			db := openDB(t, 4, "&wait_timeout=1")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			mw, err := idem.New(s, &idem.Config{Flow: f.flow})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(orderHandler(orders, nil)))
			defer srv.Close()
			const n = 8 // twice the pool
			for round := range 2 {
				var wg sync.WaitGroup
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					wg.Go(func() {
						if st, rep, body := postItem(srv.URL, key, key); st != 201 || rep {
							t.Errorf("%s: %d replayed=%v %s", key, st, rep, body)
						}
					})
				}
				wg.Wait()
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					if got := countOrders(t, db, orders, key); got != 1 {
						t.Errorf("%s: %d orders, want 1", key, got)
					}
					if st, rep, body := postItem(srv.URL, key, key); st != 201 || !rep {
						t.Errorf("%s again: %d replayed=%v %s", key, st, rep, body)
					}
				}
				time.Sleep(2500 * time.Millisecond) // past wait_timeout: the server closes every idle connection
			}
		})
	}
}

// TestWaitTimeoutEndsSleepingHandler: a handler that sleeps in its
// transaction past the session's wait_timeout has its connection closed by
// the server, which rolls its order back. The request must not be recorded as
// done, and a retry must execute once and be recorded (one order in all).
func TestWaitTimeoutEndsSleepingHandler(t *testing.T) {
	bothModes(t, testWaitTimeoutEndsSleepingHandler)
}

func testWaitTimeoutEndsSleepingHandler(t *testing.T) {
	for _, f := range idleFlows {
		t.Run(f.name, func(t *testing.T) {
			db := openDB(t, 4, "&wait_timeout=1")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			var calls atomic.Int64
			mw, err := idem.New(s, &idem.Config{Flow: f.flow})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(orderHandler(orders, func(r *http.Request) {
				if calls.Add(1) == 1 {
					time.Sleep(2500 * time.Millisecond)
				}
			})))
			defer srv.Close()
			st, _, body := postItem(srv.URL, "k", "k")
			t.Logf("first: %d %s", st, body)
			if st == 201 {
				t.Errorf("first answered 201 although the server closed its transaction's connection")
			}
			if got := countOrders(t, db, orders, "k"); got != 0 {
				t.Errorf("%d orders after the closed transaction, want 0", got)
			}
			var rep bool
			for i := range 5 {
				st, rep, body = postItem(srv.URL, "k", "k")
				t.Logf("retry %d: %d %s", i, st, body)
				if st == 201 {
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			if st != 201 || rep {
				t.Errorf("retry: %d replayed=%v %s, want a fresh 201", st, rep, body)
			}
			if st, rep, body := postItem(srv.URL, "k", "k"); st != 201 || !rep {
				t.Errorf("replay: %d replayed=%v %s", st, rep, body)
			}
			if got := countOrders(t, db, orders, "k"); got != 1 {
				t.Errorf("%d orders, want 1", got)
			}
		})
	}
}

// poolConnIDs returns the server's connection IDs of n connections of db,
// holding them all at once (so that they are n different ones) and handing
// them back idle.
func poolConnIDs(t *testing.T, db *sql.DB, n int) []int64 {
	t.Helper()
	var ids []int64
	var conns []*sql.Conn
	for range n {
		c, err := db.Conn(ctxFor(t))
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		var id int64
		if err := c.QueryRowContext(ctxFor(t), "SELECT CONNECTION_ID()").Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	for _, c := range conns {
		_ = c.Close()
	}
	return ids
}

// TestKilledIdleConns: the pool's idle connections, with the store's
// prepared statements on them, are ended by KILL CONNECTION (an operator's
// cleanup, a failover) between rounds of concurrent requests. Every request
// of the next round must execute once and replay.
func TestKilledIdleConns(t *testing.T) { bothModes(t, testKilledIdleConns) }

func testKilledIdleConns(t *testing.T) {
	admin := openDB(t, 2, "")
	for _, f := range idleFlows {
		t.Run(f.name, func(t *testing.T) {
			db := openDB(t, 4, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			mw, err := idem.New(s, &idem.Config{Flow: f.flow})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(orderHandler(orders, nil)))
			defer srv.Close()
			const n = 8 // twice the pool
			for round := range 3 {
				var wg sync.WaitGroup
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					wg.Go(func() {
						if st, rep, body := postItem(srv.URL, key, key); st != 201 || rep {
							t.Errorf("%s: %d replayed=%v %s", key, st, rep, body)
						}
					})
				}
				wg.Wait()
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					if got := countOrders(t, db, orders, key); got != 1 {
						t.Errorf("%s: %d orders, want 1", key, got)
					}
					if st, rep, body := postItem(srv.URL, key, key); st != 201 || !rep {
						t.Errorf("%s again: %d replayed=%v %s", key, st, rep, body)
					}
				}
				for _, id := range poolConnIDs(t, db, 4) {
					if _, err := admin.ExecContext(ctxFor(t), fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
	}
}
