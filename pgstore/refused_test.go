package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// TestRefusedCommitIsAborted: a deferred foreign key naming a missing row
// fails at COMMIT. PostgreSQL answered and nothing committed: that is
// idem.ErrTxAborted, not a commit of unknown outcome (503
// idempotency_commit_failed with Retry-After, which every retry met again,
// running the handler each time). A 201 becomes a non-retryable 500
// idempotency_transaction_aborted with the key released; a 409 the handler
// answered is its outcome, kept and replayed. Both flows.
func TestRefusedCommitIsAborted(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 6)
			app := newOrderApp(t, db)
			parents := pgx.Identifier{db.schema, fmt.Sprintf("parents_%d", db.n.Add(1))}.Sanitize()
			children := pgx.Identifier{db.schema, fmt.Sprintf("children_%d", db.n.Add(1))}.Sanitize()
			db.exec(t, `CREATE TABLE `+parents+` (id bigint PRIMARY KEY)`)
			db.exec(t, `CREATE TABLE `+children+` (id bigserial PRIMARY KEY, parent bigint NOT NULL REFERENCES `+parents+` DEFERRABLE INITIALLY DEFERRED)`)
			var runs atomic.Int64
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				if _, err := pgstore.Tx(r.Context()).Exec(r.Context(), `INSERT INTO `+children+` (parent) VALUES (42)`); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				status, _ := strconv.Atoi(r.URL.Query().Get("status"))
				w.WriteHeader(status)
			})))
			t.Cleanup(srv.Close)

			key := "refused-201-" + randomHex(4)
			for attempt := range 2 {
				a := post(srv.URL+"/orders?status=201", key, []byte("{}"))
				if a.err != nil {
					t.Fatal(a.err)
				}
				if a.status != 500 || problemCode(a.body) != idem.CodeTxAborted || a.header.Get("Retry-After") != "" {
					t.Fatalf("attempt %d: %d %s (Retry-After %q), want 500 %s without Retry-After", attempt, a.status, a.body, a.header.Get("Retry-After"), idem.CodeTxAborted)
				}
			}
			if n := runs.Load(); n != 2 {
				t.Fatalf("the handler ran %d times, want 2 (the key is released after each refusal)", n)
			}
			key = "refused-409-" + randomHex(4)
			for attempt := range 2 {
				a := post(srv.URL+"/orders?status=409", key, []byte("{}"))
				if a.err != nil {
					t.Fatal(a.err)
				}
				if a.status != 409 || a.replayed != (attempt == 1) {
					t.Fatalf("attempt %d: %d %s (replayed %v), want the handler's 409, replayed the second time", attempt, a.status, a.body, a.replayed)
				}
			}
			if n := runs.Load(); n != 3 {
				t.Fatalf("the handler ran %d times, want 3", n)
			}
			if n := db.count(t, `SELECT count(*) FROM `+children); n != 0 {
				t.Fatalf("%d rows committed, want 0", n)
			}
		})
	}
}

// TestRefusedCommitStoreLevel: the same at the store: Tx.Commit and
// LockedTx.Commit return errors that are idem.ErrTxAborted, and the record is
// still in flight (claim-then-complete) or absent (single transaction).
func TestRefusedCommitStoreLevel(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	parents := pgx.Identifier{db.schema, "p"}.Sanitize()
	db.exec(t, `CREATE TABLE `+parents+` (id bigint PRIMARY KEY)`)
	db.exec(t, `CREATE TABLE `+pgx.Identifier{db.schema, "c"}.Sanitize()+` (parent bigint REFERENCES `+parents+` DEFERRABLE INITIALLY DEFERRED)`)
	insert := `INSERT INTO ` + pgx.Identifier{db.schema, "c"}.Sanitize() + ` VALUES (7)`
	now := time.Now()
	req := idem.ClaimRequest{Key: "k1", Fingerprint: "v3:x", Token: "tok", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	if _, ok, err := s.Claim(ctx30(t), req); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	ctx, tx, err := s.BeginTx(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pgstore.Tx(ctx).Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, "", "k1", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); !errors.Is(err, idem.ErrTxAborted) || errors.Is(err, idem.ErrTxConflict) {
		t.Fatalf("Tx.Commit refused by a deferred foreign key: %v, want ErrTxAborted", err)
	}
	if rec, err := s.Get(ctx30(t), "", "k1", now); err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("after the refused commit: %+v, %v; want the record still in flight", rec, err)
	}
	lctx, ltx, rec, err := s.BeginLocked(context.Background(), "", "k2", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked: %v %v", rec, err)
	}
	if _, err := pgstore.Tx(lctx).Exec(lctx, insert); err != nil {
		t.Fatal(err)
	}
	if err := ltx.Insert(lctx, &idem.Record{Key: "k2", State: idem.StateComplete, Fingerprint: "v3:x", Token: "t2",
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201}}); err != nil {
		t.Fatal(err)
	}
	if err := ltx.Commit(lctx); !errors.Is(err, idem.ErrTxAborted) {
		t.Fatalf("LockedTx.Commit refused by a deferred foreign key: %v, want ErrTxAborted", err)
	}
	if _, err := s.Get(ctx30(t), "", "k2", now); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("after the refused single-transaction commit: %v, want ErrNotFound", err)
	}
	assertPoolClean(t, db)
}

// TestRollbackAndChainCommitsNothing: a handler that sends ROLLBACK AND CHAIN
// through Tx.Exec rolled its writes back and left a new transaction open
// (status 'T'). The middleware must not commit the completion in it as if the
// writes were there: the 201 is not true, so the client gets 500
// idempotency_transaction_aborted, nothing is stored, and the retry runs
// afresh. Both flows.
func TestRollbackAndChainCommitsNothing(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 4)
			app := newOrderApp(t, db)
			var chained atomic.Bool
			chained.Store(true)
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow}, app.handler("t", func(ctx context.Context) {
				if chained.Swap(false) {
					if _, err := pgstore.Tx(ctx).Exec(ctx, "ROLLBACK AND CHAIN"); err != nil {
						t.Errorf("ROLLBACK AND CHAIN: %v", err)
					}
				}
			})))
			t.Cleanup(srv.Close)
			key := "chain-" + randomHex(4)
			a := post(srv.URL+"/orders", key, []byte("{}"))
			if a.err != nil || a.status != 500 || problemCode(a.body) != idem.CodeTxAborted {
				t.Fatalf("first: %d %s %v, want 500 %s", a.status, a.body, a.err, idem.CodeTxAborted)
			}
			if n := app.ordersFor(t, key, ""); n != 0 {
				t.Fatalf("%d orders after the rollback, want 0", n)
			}
			if b := post(srv.URL+"/orders", key, []byte("{}")); b.status != 201 || b.replayed {
				t.Fatalf("retry: %d %s (replayed %v), want a fresh 201", b.status, b.body, b.replayed)
			}
			if n := app.ordersFor(t, key, ""); n != 1 {
				t.Fatalf("%d orders after the retry, want 1", n)
			}
		})
	}
}
