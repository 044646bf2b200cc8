package client_test

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// newOrderBackend keeps orders in a SQLite file (a fresh one per test) next to a
// sqlitestore: the handler inserts each order in the transaction the middleware
// opened, so the order and the stored answer commit together. The orders table
// deliberately has no unique constraint on cart_id.
func newOrderBackend(t *testing.T) *orderBackend {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, cart_id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	st, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return &orderBackend{
		store: st,
		insert: func(r *http.Request, cartID string) (int64, error) {
			tx := sqlitestore.Tx(r.Context())
			if tx == nil {
				return 0, errors.New("no idem transaction in the request context")
			}
			var id int64
			err := tx.QueryRowContext(r.Context(), `INSERT INTO orders (cart_id) VALUES (?) RETURNING id`, cartID).Scan(&id)
			return id, err
		},
		count: func(ctx context.Context) (rows, distinct int, err error) {
			err = db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT cart_id) FROM orders`).Scan(&rows, &distinct)
			return rows, distinct, err
		},
	}
}
