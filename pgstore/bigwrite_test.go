package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// TestLargeWritesInTheTransaction: a handler that writes 8 MB in one row and
// 20 000 rows through CopyFrom in the request's transaction, in both flows over
// loopback HTTP: everything commits once with the stored answer, and the retry
// replays it without writing again.
func TestLargeWritesInTheTransaction(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 8)
			app := newOrderApp(t, db)
			blobs := db.table("blobs")
			linesName := pgx.Identifier{db.schema, fmt.Sprintf("lines_%d", db.n.Add(1))}
			lines := linesName.Sanitize()
			db.exec(t, `CREATE TABLE `+blobs+` (idem_key text NOT NULL, data bytea NOT NULL)`)
			db.exec(t, `CREATE TABLE `+lines+` (idem_key text NOT NULL, n int NOT NULL)`)
			big := make([]byte, 8<<20)
			for i := range big {
				big[i] = byte(i * 7)
			}
			const nLines = 20000
			hook := func(ctx context.Context) {
				tx := pgstore.Tx(ctx)
				_, key, _ := idem.KeyFrom(ctx)
				if _, err := tx.Exec(ctx, `INSERT INTO `+blobs+` VALUES ($1, $2)`, key, big); err != nil {
					t.Errorf("blob: %v", err)
				}
				rows := make([][]any, nLines)
				for i := range rows {
					rows[i] = []any{key, i}
				}
				if n, err := tx.CopyFrom(ctx, linesName, []string{"idem_key", "n"}, pgx.CopyFromRows(rows)); err != nil || n != nLines {
					t.Errorf("CopyFrom: %d, %v", n, err)
				}
			}
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow}, app.handler("t", hook)))
			t.Cleanup(srv.Close)
			a := post(srv.URL, "k", []byte(`{}`))
			if a.err != nil || a.status != http.StatusCreated || a.replayed {
				t.Fatalf("first = %d %s %v", a.status, a.body, a.err)
			}
			b := post(srv.URL, "k", []byte(`{}`))
			if b.err != nil || b.status != http.StatusCreated || !b.replayed || string(b.body) != string(a.body) {
				t.Errorf("retry = %d replayed=%v %s %v, want the replay", b.status, b.replayed, b.body, b.err)
			}
			if o, bl, l := app.ordersFor(t, "k", ""), db.count(t, `SELECT count(*) FROM `+blobs+` WHERE length(data) = $1`, len(big)), db.count(t, `SELECT count(*) FROM `+lines); o != 1 || bl != 1 || l != nLines {
				t.Errorf("committed: %d orders, %d blobs, %d lines; want 1, 1, %d", o, bl, l, nLines)
			}
		})
	}
}
