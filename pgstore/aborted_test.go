package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// failingStatements are handler statements that make PostgreSQL abort the
// transaction they run in: a unique violation the handler catches (23505), and a
// text value with NUL, which PostgreSQL rejects (22021).
var failingStatements = []struct {
	name string
	run  func(ctx context.Context, tx pgx.Tx, orders string) error
}{
	{"unique violation", func(ctx context.Context, tx pgx.Tx, orders string) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+orders+` (id, idem_key, tag) VALUES (-1, 'dup', 'dup')`)
		return err
	}},
	{"NUL in text", func(ctx context.Context, tx pgx.Tx, orders string) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+orders+` (idem_key, tag) VALUES ($1, 'nul')`, "cart\x00id")
		return err
	}},
}

// assertPoolClean checks that no connection is left acquired and that every idle
// connection is outside a transaction.
func assertPoolClean(t *testing.T, db *testDB) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); db.pool.Stat().AcquiredConns() != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still acquired after the transaction ended", db.pool.Stat().AcquiredConns())
		}
	}
	conns := db.pool.AcquireAllIdle(ctx30(t))
	for _, c := range conns {
		if st := c.Conn().PgConn().TxStatus(); st != 'I' {
			t.Errorf("an idle pooled connection has transaction status %q, want 'I'", st)
		}
		c.Release()
	}
}

// TestTxAbortedClaimComplete: a statement of the handler failed and PostgreSQL
// aborted the transaction; Tx.Commit reports idem.ErrTxAborted, commits nothing
// (the record stays in flight under the claim's token) and leaves the connection
// clean.
func TestTxAbortedClaimComplete(t *testing.T) {
	t.Parallel()
	for _, fs := range failingStatements {
		t.Run(fs.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 4)
			app := newOrderApp(t, db)
			db.exec(t, `INSERT INTO `+app.orders+` (id, idem_key, tag) VALUES (-1, 'dup', 'dup')`)
			now := time.Now()
			if _, claimed, err := app.store.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:f", Token: "tok",
				Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
				t.Fatalf("Claim: %v %v", claimed, err)
			}
			ctx, tx, err := app.store.BeginTx(ctx30(t))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if _, err := pgstore.Tx(ctx).Exec(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ('k', 'before')`); err != nil {
				t.Fatal(err)
			}
			if err := fs.run(ctx, pgstore.Tx(ctx), app.orders); err == nil {
				t.Fatal("the failing statement succeeded")
			}
			err = tx.Complete(ctx30(t), "s", "k", "tok", &idem.Response{Status: 409, Body: []byte("conflict")}, now, now.Add(time.Hour))
			if err == nil {
				err = tx.Commit(ctx30(t))
			}
			_ = tx.Rollback(ctx30(t))
			if !errors.Is(err, idem.ErrTxAborted) {
				t.Fatalf("Complete+Commit of an aborted transaction = %v, want idem.ErrTxAborted", err)
			}
			if rec, err := app.store.Get(ctx30(t), "s", "k", now); err != nil || rec.State != idem.StateInFlight || rec.Token != "tok" {
				t.Fatalf("record after the aborted commit = %+v, %v; want still in flight under tok", rec, err)
			}
			if n := app.ordersFor(t, "k", ""); n != 0 {
				t.Fatalf("%d orders committed from the aborted transaction", n)
			}
			assertPoolClean(t, db)
			// The plain, fenced completion the middleware falls back to works.
			if err := app.store.Complete(ctx30(t), "s", "k", "tok", &idem.Response{Status: 409}, now, now.Add(time.Hour)); err != nil {
				t.Fatalf("Store.Complete after the aborted transaction: %v", err)
			}
		})
	}
}

// TestTxAbortedSingleTx is TestTxAbortedClaimComplete for LockedTx: Commit
// reports idem.ErrTxAborted, no record is written, and the lock is free.
func TestTxAbortedSingleTx(t *testing.T) {
	t.Parallel()
	for _, fs := range failingStatements {
		t.Run(fs.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 4)
			app := newOrderApp(t, db)
			db.exec(t, `INSERT INTO `+app.orders+` (id, idem_key, tag) VALUES (-1, 'dup', 'dup')`)
			now := time.Now()
			ctx, tx, rec, err := app.store.BeginLocked(ctx30(t), "s", "k", now)
			if err != nil || rec != nil {
				t.Fatalf("BeginLocked: %+v %v", rec, err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if err := fs.run(ctx, pgstore.Tx(ctx), app.orders); err == nil {
				t.Fatal("the failing statement succeeded")
			}
			err = tx.Insert(ctx30(t), &idem.Record{Scope: "s", Key: "k", State: idem.StateComplete, Fingerprint: "v1:f", Token: "t",
				CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 409}})
			if err == nil {
				err = tx.Commit(ctx30(t))
			}
			_ = tx.Rollback(ctx30(t))
			if !errors.Is(err, idem.ErrTxAborted) {
				t.Fatalf("Insert+Commit in an aborted transaction = %v, want idem.ErrTxAborted", err)
			}
			if _, err := app.store.Get(ctx30(t), "s", "k", now); !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("Get after the aborted commit = %v, want ErrNotFound", err)
			}
			assertPoolClean(t, db)
			_, tx2, _, err := app.store.BeginLocked(ctx30(t), "s", "k", now)
			if err != nil {
				t.Fatalf("BeginLocked after the aborted commit = %v; the lock must be free", err)
			}
			_ = tx2.Rollback(ctx30(t))
		})
	}
}

// TestTxAbortedCommitWithoutCompletion: Commit with no completion prepared, on a
// transaction PostgreSQL aborted (COMMIT answers ROLLBACK), reports ErrTxAborted.
func TestTxAbortedCommitWithoutCompletion(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s := db.newStore(t)
	ctx, tx, err := s.BeginTx(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := pgstore.Tx(ctx).Exec(ctx, `SELECT 1/0`); err == nil {
		t.Fatal("1/0 succeeded")
	}
	err = tx.Commit(ctx30(t))
	_ = tx.Rollback(ctx30(t))
	if !errors.Is(err, idem.ErrTxAborted) {
		t.Fatalf("Commit of an aborted transaction = %v, want idem.ErrTxAborted", err)
	}
	assertPoolClean(t, db)
}

// TestTxAbortedThroughMiddleware: a handler whose statement fails (and aborts
// the transaction) catches the error and answers 409. The client gets the 409,
// the retry replays it without running the handler again, and nothing of the
// aborted transaction is committed. (It used to answer 503 commit failed, and
// every retry ran the handler again.)
func TestTxAbortedThroughMiddleware(t *testing.T) {
	t.Parallel()
	for _, fl := range flows {
		for _, fs := range failingStatements {
			t.Run(fl.name+"/"+fs.name, func(t *testing.T) {
				t.Parallel()
				db := newTestDB(t, 4)
				app := newOrderApp(t, db)
				db.exec(t, `INSERT INTO `+app.orders+` (id, idem_key, tag) VALUES (-1, 'dup', 'dup')`)
				var runs atomic.Int64
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					ctx := r.Context()
					tx := pgstore.Tx(ctx)
					_, key, _ := idem.KeyFrom(ctx)
					if _, err := tx.Exec(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ($1, 'first')`, key); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					if err := fs.run(ctx, tx, app.orders); err != nil {
						w.Header().Set("Content-Type", "application/json")
						w.WriteHeader(http.StatusConflict)
						_, _ = w.Write([]byte(`{"error":"conflict"}`))
						return
					}
					w.WriteHeader(http.StatusCreated)
				})
				srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: fl.flow}, h))
				defer srv.Close()
				key := "abort-" + randomHex(8)
				first := post(srv.URL+"/orders", key, []byte(`{"item":"x"}`))
				if first.err != nil || first.status != http.StatusConflict || first.replayed || string(first.body) != `{"error":"conflict"}` {
					t.Fatalf("first = %d replayed=%v %s (err %v); want the handler's 409", first.status, first.replayed, first.body, first.err)
				}
				again := post(srv.URL+"/orders", key, []byte(`{"item":"x"}`))
				if again.err != nil || again.status != http.StatusConflict || !again.replayed || !bytes.Equal(again.body, first.body) {
					t.Fatalf("retry = %d replayed=%v %s (err %v); want a replay of the 409", again.status, again.replayed, again.body, again.err)
				}
				if n := runs.Load(); n != 1 {
					t.Fatalf("the handler ran %d times, want 1", n)
				}
				if n := app.ordersFor(t, key, ""); n != 0 {
					t.Fatalf("%d orders of the aborted transaction committed", n)
				}
				assertPoolClean(t, db)
			})
		}
	}
}
