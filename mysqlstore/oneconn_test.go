package mysqlstore_test

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/burst"
	"github.com/idemkit/idem/mysqlstore"
)

// TestOneConnectionPool: a *sql.DB limited to one connection serves
// first-time requests, duplicates and replays in both flows, with the order
// written through mysqlstore.Tx. No transaction of the store waits for a
// second connection.
func TestOneConnectionPool(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 1, "")
			orders := randomName("idem_test_orders_")
			if _, err := db.Exec("CREATE TABLE " + orders + " (id BIGINT AUTO_INCREMENT PRIMARY KEY, cart VARCHAR(64) NOT NULL)"); err != nil {
				t.Fatal(err)
			}
			dropAtEnd(t, db, orders)
			store := newStore(t, db)
			mw, err := idem.New(store, &idem.Config{Flow: flow})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				cart := r.Header.Get("Idempotency-Key")
				if _, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO "+orders+" (cart) VALUES (?)", cart); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
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
			var n, distinct int
			if err := db.QueryRow("SELECT count(*), count(DISTINCT cart) FROM "+orders).Scan(&n, &distinct); err != nil {
				t.Fatal(err)
			}
			if n != distinct || n > keys {
				t.Fatalf("%d orders for %d carts, want at most one per cart", n, distinct)
			}
		})
	}
}
