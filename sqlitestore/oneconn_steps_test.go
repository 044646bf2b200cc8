package sqlitestore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/burst"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestOneConnectionPoolSteps: a *sql.DB limited to one connection serves
// handlers that write in the request's transaction and record a step, in
// both flows, with duplicates of each key at once: every step runs once per
// key, one order per key, and nothing waits for a second connection of the
// records' pool.
func TestOneConnectionPoolSteps(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db, err := embedded.Open(filepath.Join(t.TempDir(), "app.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			db.SetMaxOpenConns(1)
			if _, err := db.Exec(`CREATE TABLE orders (id INTEGER PRIMARY KEY, cart TEXT NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			store, err := sqlitestore.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			mw, err := idem.New(store, &idem.Config{Flow: flow})
			if err != nil {
				t.Fatal(err)
			}
			var callsMu sync.Mutex
			calls := map[string]int{}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				cart := r.Header.Get("Idempotency-Key")
				if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), `INSERT INTO orders (cart) VALUES (?)`, cart); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				if _, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) {
					callsMu.Lock()
					calls[cart]++
					callsMu.Unlock()
					return key, nil
				}); err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			// The server and the store are closed on success only: their
			// Close waits for the handlers, which stand still for ever when
			// the bug is back.

			const keys = 4
			a, ok := burst.Keyed(srv.URL+"/orders", keys, 4, 30*time.Second)
			if !ok {
				t.Fatal("requests with steps through a one-connection pool did not finish in 30 s: something waits for a second connection")
			}
			srv.Close()
			if err := store.Close(); err != nil {
				t.Fatal(err)
			}
			if !a.OnlyCreatedAndConflicts() {
				t.Fatalf("answers %v, want 201s (first-time and replayed) and 409s only", a)
			}
			var n, distinct int
			if err := db.QueryRow(`SELECT count(*), count(DISTINCT cart) FROM orders`).Scan(&n, &distinct); err != nil {
				t.Fatal(err)
			}
			if n != distinct || n > keys {
				t.Fatalf("%d orders for %d carts, want at most one per cart", n, distinct)
			}
			for cart, c := range calls {
				if c != 1 {
					t.Errorf("step of %s ran %d times, want once", cart, c)
				}
			}
		})
	}
}
