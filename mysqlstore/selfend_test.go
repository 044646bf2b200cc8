package mysqlstore_test

import (
	"bytes"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

func postOrder(t *testing.T, url, key, item string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader([]byte(`{"item":"`+item+`"}`)))
	req.Header.Set("Idempotency-Key", key)
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get(idem.ReplayedHeader), string(b)
}

// A handler's own savepoints inside the request's transaction, and a handler
// that rolls the transaction back (tx.Rollback, or ROLLBACK as SQL) on its first
// attempt, or releases the store's own savepoint idem_tx: in both flows and both modes, over loopback HTTP, the savepoint's
// rollback undoes only its row, a rollback commits nothing and releases the key,
// and the retry runs afresh: one order in the end.
func TestHandlerSavepointsAndRollback(t *testing.T) { bothModes(t, testHandlerSavepointsAndRollback) }

func testHandlerSavepointsAndRollback(t *testing.T) {
	cases := map[string]struct {
		first   func(r *http.Request, orders string) // on the first attempt, after the insert
		firstOK bool                                 // the first attempt answers 201
	}{
		"savepoint": {func(r *http.Request, orders string) {
			tx := mysqlstore.Tx(r.Context())
			for _, q := range []string{"SAVEPOINT sp", "INSERT INTO `" + orders + "` (item) VALUES ('book')", "ROLLBACK TO SAVEPOINT sp", "RELEASE SAVEPOINT sp"} {
				if _, err := tx.ExecContext(r.Context(), q); err != nil {
					t.Errorf("%s: %v", q, err)
				}
			}
		}, true},
		"tx.Rollback": {func(r *http.Request, _ string) { _ = mysqlstore.Tx(r.Context()).Rollback() }, false},
		"ROLLBACK": {func(r *http.Request, _ string) {
			_, _ = mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "ROLLBACK")
		}, false},
		"RELEASE idem_tx": {func(r *http.Request, _ string) {
			_, _ = mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "RELEASE SAVEPOINT idem_tx")
		}, false},
	}
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		for name, c := range cases {
			t.Run(flow.String()+"/"+name, func(t *testing.T) {
				t.Parallel()
				db := openDB(t, 8, "")
				s := newStore(t, db)
				orders := ordersTable(t, db)
				var calls atomic.Int32
				srv := newServer(t, s, &idem.Config{Flow: flow}, orderHandler(orders, func(r *http.Request) {
					if calls.Add(1) == 1 {
						c.first(r, orders)
					}
				}))
				key := randomName("k-")
				st, _, body := postOrder(t, srv.URL, key, "book")
				n1 := countOrders(t, db, orders, "book")
				st2, rep, body2 := postOrder(t, srv.URL, key, "book")
				n2 := countOrders(t, db, orders, "book")
				t.Logf("first %d %s (orders %d); retry %d %q %s (orders %d)", st, body, n1, st2, rep, body2, n2)
				want1 := 0
				if c.firstOK {
					want1 = 1
				}
				if (st == http.StatusCreated) != c.firstOK || n1 != want1 {
					t.Errorf("first = %d %s with %d orders after it, want 201=%v and %d", st, body, n1, c.firstOK, want1)
				}
				if n2 != 1 || st2 != http.StatusCreated || (rep == "true") != c.firstOK {
					t.Errorf("after the retry (%d %q %s): %d orders, want 1", st2, rep, body2, n2)
				}
			})
		}
	}
}
