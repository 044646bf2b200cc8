package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// A Commit called after the transaction's context ended (the handler's, which
// ends at HandlerTimeout or when the lease is lost) commits nothing, in BeginTx
// and BeginLocked alike, as in sqlitestore and mysqlstore: the handler's writes
// and the record are rolled back, and the connection goes back to the pool.
func TestCommitAfterContextEndCommitsNothing(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	orders := db.table("orders")
	db.exec(t, "CREATE TABLE "+orders+" (id bigserial PRIMARY KEY, item text NOT NULL)")
	for i := range 20 {
		ctx, cancel := context.WithCancel(context.Background())
		now := time.Now()
		key := fmt.Sprintf("after-end-%d", i)
		var tctx context.Context
		var tx interface {
			Commit(context.Context) error
			Rollback(context.Context) error
		}
		var err error
		locked := i%2 == 1
		if !locked {
			var claimed bool
			_, claimed, err = s.Claim(context.Background(), idem.ClaimRequest{Key: key, Fingerprint: "v1:x", Token: "tok", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
			if err == nil && !claimed {
				err = errors.New("not claimed")
			}
			if err == nil {
				tctx, tx, err = s.BeginTx(ctx)
			}
		} else {
			var ltx idem.LockedTx
			var rec *idem.Record
			tctx, ltx, rec, err = s.BeginLocked(ctx, "", key, now)
			if err == nil && rec != nil {
				err = errors.New("BeginLocked found a record")
			}
			tx = ltx
		}
		if err != nil {
			cancel()
			t.Fatalf("round %d: begin: %v", i, err)
		}
		if _, err := pgstore.Tx(tctx).Exec(context.Background(), "INSERT INTO "+orders+" (item) VALUES ('late')"); err != nil {
			cancel()
			t.Fatalf("round %d: insert: %v", i, err)
		}
		resp := &idem.Response{Status: 201, Body: []byte("late")}
		if locked {
			err = tx.(idem.LockedTx).Insert(context.Background(), &idem.Record{Key: key, State: idem.StateComplete, Fingerprint: "v1:x",
				CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: resp})
		} else {
			err = tx.(idem.Tx).Complete(context.Background(), "", key, "tok", resp, now, now.Add(time.Hour))
		}
		if err != nil {
			cancel()
			t.Fatalf("round %d: record: %v", i, err)
		}
		cancel()
		err = tx.Commit(context.Background())
		_ = tx.Rollback(context.Background())
		if n := db.count(t, "SELECT count(*) FROM "+orders+" WHERE item = 'late'"); n != 0 || err == nil {
			t.Fatalf("round %d (locked %v): Commit after the context ended = %v, %d orders committed; want an error and none", i, locked, err, n)
		}
	}
}

// A handler that ignores its context and returns after HandlerTimeout, its
// order written in the transaction before the deadline, commits nothing in
// either flow: 503 idempotency_commit_failed, no order, and the retry runs the
// handler afresh.
func TestHandlerPastTimeoutCommitsNothing(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 8)
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			a := newOrderApp(t, db)
			var runs atomic.Int64
			h := a.serve(t, &idem.Config{Flow: f.flow, HandlerTimeout: 100 * time.Millisecond}, a.handler("slow", func(context.Context) {
				if runs.Add(1) == 1 {
					time.Sleep(500 * time.Millisecond) // five times HandlerTimeout, ignoring the context
				}
			}))
			srv := httptest.NewServer(h)
			defer srv.Close()
			first := post(srv.URL, "k", []byte(`{}`))
			if first.err != nil || first.status != http.StatusServiceUnavailable || problemCode(first.body) != idem.CodeCommitFailed {
				t.Fatalf("past HandlerTimeout: %d %s %v, want 503 %s", first.status, first.body, first.err, idem.CodeCommitFailed)
			}
			if n := a.ordersFor(t, "k", ""); n != 0 {
				t.Fatalf("%d orders committed by a handler past HandlerTimeout, want 0", n)
			}
			retry := post(srv.URL, "k", []byte(`{}`))
			if retry.err != nil || retry.status != http.StatusCreated || retry.replayed {
				t.Fatalf("retry: %d %s %v, want a fresh 201", retry.status, retry.body, retry.err)
			}
			if n := a.ordersFor(t, "k", ""); n != 1 {
				t.Fatalf("%d orders after the retry, want 1", n)
			}
		})
	}
}
