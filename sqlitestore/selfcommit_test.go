package sqlitestore_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// A handler that ends the request's transaction itself, on its first attempt
// only, in both flows, over loopback HTTP. What sqlitestore.Tx documents:
//   - tx.Rollback: nothing commits, the key is released, and the retry runs
//     afresh (one order in the end, answered 201 without the replay header);
//   - COMMIT sent as SQL: the order commits, the completion runs after it (on
//     the same connection, outside the transaction) and the retry replays it
//     (one order in the end).
func TestHandlerEndsTransactionItself(t *testing.T) {
	t.Parallel()
	ends := map[string]struct {
		end        func(ctx context.Context)
		afterFirst int  // orders after the first attempt
		replayed   bool // the retry replays (else it runs afresh)
	}{
		"tx.Rollback": {func(ctx context.Context) { _ = sqlitestore.Tx(ctx).Rollback() }, 0, false},
		"COMMIT":      {func(ctx context.Context) { _, _ = sqlitestore.Tx(ctx).ExecContext(ctx, "COMMIT") }, 1, true},
	}
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		for name, c := range ends {
			t.Run(flow.String()+"/"+name, func(t *testing.T) {
				t.Parallel()
				db := openDB(t)
				createOrders(t, db)
				store := newStore(t, db)
				var calls atomic.Int32
				srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(func(ctx context.Context) {
					if calls.Add(1) == 1 {
						c.end(ctx)
					}
				}))
				a := post(t, srv.URL, "k", "book")
				if a.status == http.StatusCreated {
					t.Errorf("first attempt = %d %s, want an error answer: the handler ended the transaction", a.status, a.body)
				}
				if n := countOrders(t, db); n != c.afterFirst {
					t.Errorf("%d orders after the first attempt (%d %s), want %d", n, a.status, a.body, c.afterFirst)
				}
				b := post(t, srv.URL, "k", "book")
				if b.status != http.StatusCreated || (b.header.Get(idem.ReplayedHeader) == "true") != c.replayed {
					t.Errorf("retry = %d replayed=%q %s, want 201 replayed=%v", b.status, b.header.Get(idem.ReplayedHeader), b.body, c.replayed)
				}
				if n := countOrders(t, db); n != 1 {
					t.Errorf("%d orders after the retry, want 1", n)
				}
				rec, err := store.Get(context.Background(), "", "k", time.Now())
				if err != nil || rec.State != idem.StateComplete || string(rec.Response.Body) != b.body {
					t.Errorf("record after the retry = %+v, %v; want complete with the retry's body", rec, err)
				}
			})
		}
	}
}

// Savepoints inside the request's transaction work in both flows: a handler
// that writes an extra row in a savepoint, rolls back to it and releases it
// commits only its order, answered 201 and replayed to the retry.
func TestHandlerSavepoints(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			createOrders(t, db)
			store := newStore(t, db)
			srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(func(ctx context.Context) {
				tx := sqlitestore.Tx(ctx)
				for _, q := range []string{"SAVEPOINT sp", "INSERT INTO orders (item) VALUES ('undone')", "ROLLBACK TO sp", "RELEASE sp"} {
					if _, err := tx.ExecContext(ctx, q); err != nil {
						t.Errorf("%s: %v", q, err)
					}
				}
			}))
			a := post(t, srv.URL, "k", "book")
			if a.status != http.StatusCreated {
				t.Fatalf("first = %d %s, want 201", a.status, a.body)
			}
			b := post(t, srv.URL, "k", "book")
			if b.status != http.StatusCreated || b.header.Get(idem.ReplayedHeader) != "true" || b.body != a.body {
				t.Errorf("retry = %d %q %s, want the replayed 201", b.status, b.header.Get(idem.ReplayedHeader), b.body)
			}
			if n, m := countOrders(t, db), countOrdersItem(t, db, "undone"); n != 1 || m != 0 {
				t.Errorf("%d orders, %d of them rolled back to the savepoint; want 1 and 0", n, m)
			}
		})
	}
}
