package mysqlstore_test

import (
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// TestLongStatementPastHandlerTimeout: the handler's statement (SLEEP(60))
// outlasts HandlerTimeout (1 s). It must be cancelled at the deadline (the
// client hears back long before 60 s), the order must not commit, the client
// gets 503 idempotency_commit_failed, and the retry runs afresh. Both flows and
// both modes, over loopback HTTP.
func TestLongStatementPastHandlerTimeout(t *testing.T) {
	bothModes(t, testLongStatementPastHandlerTimeout)
}

func testLongStatementPastHandlerTimeout(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 8, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			var calls atomic.Int32
			srv := newServer(t, s, &idem.Config{Flow: flow, HandlerTimeout: time.Second}, orderHandler(orders, func(r *http.Request) {
				if calls.Add(1) == 1 {
					_, _ = mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "SELECT SLEEP(60)") // error ignored
				}
			}))
			key := randomName("k-")
			start := time.Now()
			st, _, body := postOrder(t, srv.URL, key, "book")
			if took := time.Since(start); took > 30*time.Second {
				t.Errorf("the answer took %v: the statement was not cancelled at HandlerTimeout", took)
			}
			if st != http.StatusServiceUnavailable {
				t.Errorf("first = %d %s, want 503 %s", st, body, idem.CodeCommitFailed)
			}
			if n := countOrders(t, db, orders, "book"); n != 0 {
				t.Errorf("%d orders after the timed-out attempt, want 0", n)
			}
			// The driver closes its connection at the deadline, but the server
			// runs the statement on until it notices (MariaDB's SLEEP checks
			// every few seconds; another statement may not until it ends). In the
			// claim-then-complete flow the key is released at once; in the single
			// transaction the session holding the key's lock lives that long, and
			// retries get 409 idempotency_key_in_use meanwhile (see doc.go).
			var rep string
			for deadline := time.Now().Add(90 * time.Second); ; {
				st, rep, body = postOrder(t, srv.URL, key, "book")
				if flow != idem.FlowSingleTx || st != http.StatusConflict || time.Now().After(deadline) {
					break
				}
				time.Sleep(500 * time.Millisecond) // polling the documented wait, not synchronising
			}
			t.Logf("retry answered %d after %v", st, time.Since(start))
			if st != http.StatusCreated || rep == "true" {
				t.Errorf("retry = %d %q %s, want a fresh 201", st, rep, body)
			}
			if n := countOrders(t, db, orders, "book"); n != 1 {
				t.Errorf("%d orders after the retry, want 1", n)
			}
		})
	}
}
