package pgstore_test

import (
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/burst"
)

// TestOneConnectionPool: a pool of one connection serves first-time
// requests, duplicates and replays in both flows, with the order written
// through pgstore.Tx. No transaction of the store waits for a second
// connection.
func TestOneConnectionPool(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			app := newOrderApp(t, newTestDB(t, 1))
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: flow}, app.handler("one", nil)))
			// Closed on success only: Close waits for the handlers, which
			// stand still for ever if a transaction waits for a second
			// connection.
			const keys = 4
			a, ok := burst.Keyed(srv.URL+"/orders", keys, 4, 60*time.Second)
			if !ok {
				t.Fatal("requests through a one-connection pool did not finish in 60 s: a transaction waits for a second connection")
			}
			srv.Close()
			if !a.OnlyCreatedAndConflicts() {
				t.Fatalf("answers %v, want 201s (first-time and replayed) and 409s only", a)
			}
			for k := range keys {
				if n := app.ordersFor(t, fmt.Sprintf("cart-%d", k), ""); n > 1 {
					t.Fatalf("cart-%d has %d orders, want at most one", k, n)
				}
			}
		})
	}
}
