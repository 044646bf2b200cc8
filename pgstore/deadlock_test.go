package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// TestDeadlockBetweenKeys: two requests with different keys each lock one row
// of a stock table and then the other's, in opposite orders, through the
// middleware over loopback HTTP. PostgreSQL breaks the deadlock by aborting one
// transaction; its handler ignores the error (a best-effort update) and answers
// 201. Exactly one request succeeds and commits its order and both updates; the
// other commits nothing, its client gets 503 idempotency_transaction_conflict
// (a deadlock is a conflict with a concurrent transaction: idem.ErrTxConflict),
// its key is released, and its retry runs afresh. The winner's retry replays.
func TestDeadlockBetweenKeys(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 8)
			app := newOrderApp(t, db)
			stock := pgx.Identifier{db.schema, fmt.Sprintf("stock_%d", db.n.Add(1))}.Sanitize()
			db.exec(t, `CREATE TABLE `+stock+` (id int PRIMARY KEY, n int NOT NULL)`)
			db.exec(t, `INSERT INTO `+stock+` VALUES (1, 0), (2, 0)`)

			var attempts atomic.Int32
			var locked sync.WaitGroup // both first attempts hold their first row
			locked.Add(2)
			hook := func(ctx context.Context) {
				tx := pgstore.Tx(ctx)
				_, key, _ := idem.KeyFrom(ctx)
				first, second := 1, 2
				if key == "kB" {
					first, second = 2, 1
				}
				if _, err := tx.Exec(ctx, `UPDATE `+stock+` SET n = n + 1 WHERE id = $1`, first); err != nil {
					t.Errorf("%s: first update: %v", key, err)
				}
				if attempts.Add(1) <= 2 {
					locked.Done()
					locked.Wait()
				}
				_, _ = tx.Exec(ctx, `UPDATE `+stock+` SET n = n + 1 WHERE id = $1`, second) // best effort: error ignored
			}
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow}, app.handler("t", hook)))
			t.Cleanup(srv.Close)

			answers := map[string]answer{}
			var mu sync.Mutex
			var wg sync.WaitGroup
			for _, k := range []string{"kA", "kB"} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					a := post(srv.URL, k, []byte(`{}`))
					mu.Lock()
					answers[k] = a
					mu.Unlock()
				}()
			}
			wg.Wait()
			var winner, loser string
			for k, a := range answers {
				switch {
				case a.err != nil:
					t.Fatalf("%s: %v", k, a.err)
				case a.status == http.StatusCreated && !a.replayed:
					winner = k
				case a.status == http.StatusServiceUnavailable && problemCode(a.body) == idem.CodeTxConflict && a.header.Get("Retry-After") != "":
					loser = k
				default:
					t.Fatalf("%s: %d %s", k, a.status, a.body)
				}
			}
			if winner == "" || loser == "" {
				t.Fatalf("answers %v: want one 201 and one 503 %s", answers, idem.CodeTxConflict)
			}
			if w, l := app.ordersFor(t, winner, ""), app.ordersFor(t, loser, ""); w != 1 || l != 0 {
				t.Errorf("orders: winner %d, loser %d; want 1 and 0", w, l)
			}
			if n := db.count(t, `SELECT sum(n) FROM `+stock); n != 2 {
				t.Errorf("stock updates committed: %d, want the winner's 2", n)
			}
			if a := post(srv.URL, loser, []byte(`{}`)); a.err != nil || a.status != http.StatusCreated || a.replayed {
				t.Errorf("loser's retry = %d replayed=%v %s %v, want a fresh 201", a.status, a.replayed, a.body, a.err)
			}
			if a := post(srv.URL, winner, []byte(`{}`)); a.err != nil || a.status != http.StatusCreated || !a.replayed || string(a.body) != string(answers[winner].body) {
				t.Errorf("winner's retry = %d replayed=%v %s %v, want the replay", a.status, a.replayed, a.body, a.err)
			}
			if w, l := app.ordersFor(t, winner, ""), app.ordersFor(t, loser, ""); w != 1 || l != 1 {
				t.Errorf("orders after the retries: winner %d, loser %d; want 1 and 1", w, l)
			}
			if n := db.count(t, `SELECT sum(n) FROM `+stock); n != 4 {
				t.Errorf("stock updates after the retries: %d, want 4", n)
			}
		})
	}
}
