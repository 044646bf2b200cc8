package pgstore_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
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
			const keys, copies = 4, 4
			var wg sync.WaitGroup
			start := make(chan struct{})
			var mu sync.Mutex
			codes := map[int]int{}
			for k := range keys {
				for range copies {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						a := post(srv.URL+"/orders", fmt.Sprintf("cart-%d", k), []byte(`{}`))
						mu.Lock()
						defer mu.Unlock()
						if a.err != nil {
							codes[-1]++
							return
						}
						codes[a.status]++
					}()
				}
			}
			close(start)
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(60 * time.Second):
				t.Fatal("requests through a one-connection pool did not finish in 60 s: a transaction waits for a second connection")
			}
			srv.Close()
			if codes[http.StatusCreated] == 0 || codes[-1] > 0 || codes[http.StatusInternalServerError] > 0 {
				t.Fatalf("answers %v, want 201s (first-time and replayed) and 409s only", codes)
			}
			for k := range keys {
				if n := app.ordersFor(t, fmt.Sprintf("cart-%d", k), ""); n > 1 {
					t.Fatalf("cart-%d has %d orders, want at most one", k, n)
				}
			}
		})
	}
}
