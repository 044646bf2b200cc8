package sqlitestore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/burst"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestOneConnectionPool: a *sql.DB limited to one connection
// (SetMaxOpenConns(1), a common SQLite setting) serves first-time requests,
// duplicates and replays in both flows. The first request of a fresh Store
// used to hang for ever: its transaction held the pool's one connection and
// its first statement waited for another to be prepared on.
func TestOneConnectionPool(t *testing.T) {
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
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				cart := r.Header.Get("Idempotency-Key")
				if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), `INSERT INTO orders (cart) VALUES (?)`, cart); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
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
				t.Fatal("requests through a one-connection pool did not finish in 30 s: a transaction waits for a second connection")
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
		})
	}
}
