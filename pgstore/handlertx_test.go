package pgstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// assertTxClosed checks that every statement method of the handler's tx returns
// pgx.ErrTxClosed and that no order was written through it.
func assertTxClosed(t *testing.T, app *orderApp, tx pgx.Tx, key string) {
	t.Helper()
	ctx := ctx30(t)
	ins := `INSERT INTO ` + app.orders + ` (idem_key, tag) VALUES ($1, 'late')`
	if _, err := tx.Exec(ctx, ins, key); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Exec after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	var id int64
	if err := tx.QueryRow(ctx, ins+` RETURNING id`, key).Scan(&id); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("QueryRow after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	rows, err := tx.Query(ctx, ins+` RETURNING id`, key)
	if !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Query after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if rows != nil {
		rows.Close()
	}
	b := &pgx.Batch{}
	b.Queue(ins, key)
	if err := tx.SendBatch(ctx, b).Close(); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("SendBatch after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if _, err := tx.CopyFrom(ctx, pgx.Identifier{"x"}, []string{"a"}, pgx.CopyFromRows(nil)); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("CopyFrom after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if _, err := tx.Begin(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Begin after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Commit after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if err := tx.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Rollback after the transaction ended = %v, want pgx.ErrTxClosed", err)
	}
	if n := app.ordersFor(t, key, "late"); n != 0 {
		t.Errorf("%d orders written through the handler's tx after its transaction ended", n)
	}
}

// endings are the ways the middleware ends a request's transaction.
var endings = []string{"commit", "rollback", "failed commit"}

// TestHandlerTxClosedAfterClaimTx: after Commit, Rollback or a fenced-out
// Commit of the claim-then-complete flow, the handler's tx refuses statements
// (it used to autocommit them on the pooled connection).
func TestHandlerTxClosedAfterClaimTx(t *testing.T) {
	t.Parallel()
	for _, ending := range endings {
		t.Run(ending, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 1) // one connection: the late statement would land on it
			app := newOrderApp(t, db)
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
			htx := pgstore.Tx(ctx)
			if _, err := htx.Exec(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ('k', 'in')`); err != nil {
				t.Fatal(err)
			}
			token := "tok"
			if ending == "failed commit" {
				token = "stale"
			}
			switch ending {
			case "rollback":
				err = tx.Rollback(ctx30(t))
			default:
				if err = tx.Complete(ctx30(t), "s", "k", token, &idem.Response{Status: 201}, now, now.Add(time.Hour)); err == nil {
					err = tx.Commit(ctx30(t))
				}
			}
			if want := map[string]error{"commit": nil, "rollback": nil, "failed commit": idem.ErrLockLost}[ending]; !errors.Is(err, want) {
				t.Fatalf("%s = %v, want %v", ending, err, want)
			}
			_ = tx.Rollback(ctx30(t))
			assertTxClosed(t, app, htx, "k")
		})
	}
}

// TestHandlerTxClosedAfterLockedTx is TestHandlerTxClosedAfterClaimTx for the
// single-transaction flow.
func TestHandlerTxClosedAfterLockedTx(t *testing.T) {
	t.Parallel()
	for _, ending := range endings {
		t.Run(ending, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 2)
			app := newOrderApp(t, db)
			now := time.Now()
			ctx, tx, rec, err := app.store.BeginLocked(ctx30(t), "s", "k", now)
			if err != nil || rec != nil {
				t.Fatal(rec, err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			htx := pgstore.Tx(ctx)
			if _, err := htx.Exec(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ('k', 'in')`); err != nil {
				t.Fatal(err)
			}
			if ending == "failed commit" { // a claim after the lookup makes the insert fail
				if _, claimed, err := app.store.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:f", Token: "tok",
					Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
					t.Fatalf("Claim: %v %v", claimed, err)
				}
			}
			switch ending {
			case "rollback":
				err = tx.Rollback(ctx30(t))
			default:
				err = tx.Insert(ctx30(t), &idem.Record{Scope: "s", Key: "k", State: idem.StateComplete, Fingerprint: "v1:f", Token: "t",
					CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201}})
				if err == nil {
					err = tx.Commit(ctx30(t))
				}
			}
			if want := map[string]error{"commit": nil, "rollback": nil, "failed commit": idem.ErrInFlight}[ending]; !errors.Is(err, want) {
				t.Fatalf("%s = %v, want %v", ending, err, want)
			}
			_ = tx.Rollback(ctx30(t))
			assertTxClosed(t, app, htx, "k")
		})
	}
}

// TestHandlerTxConcurrentCommit: a goroutine the handler left behind keeps
// writing through the tx while the middleware commits. Its writes either commit
// with the transaction or fail with pgx.ErrTxClosed; none begun after Commit
// returned succeeds, none lands outside the transaction, and -race sees no
// concurrent use of the connection.
func TestHandlerTxConcurrentCommit(t *testing.T) {
	t.Parallel()
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 2)
			app := newOrderApp(t, db)
			now := time.Now()
			var (
				ctx    context.Context
				commit func() error
				err    error
			)
			switch fl.flow {
			case idem.FlowClaimComplete:
				if _, claimed, err := app.store.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:f", Token: "tok",
					Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
					t.Fatalf("Claim: %v %v", claimed, err)
				}
				var tx idem.Tx
				ctx, tx, err = app.store.BeginTx(ctx30(t))
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(context.Background()) }()
				commit = func() error {
					_ = tx.Complete(ctx30(t), "s", "k", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour))
					return tx.Commit(ctx30(t))
				}
			default:
				var tx idem.LockedTx
				ctx, tx, _, err = app.store.BeginLocked(ctx30(t), "s", "k", now)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(context.Background()) }()
				commit = func() error {
					_ = tx.Insert(ctx30(t), &idem.Record{Scope: "s", Key: "k", State: idem.StateComplete, Fingerprint: "v1:f", Token: "t",
						CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201}})
					return tx.Commit(ctx30(t))
				}
			}
			htx := pgstore.Tx(ctx)
			var committed atomic.Bool
			type result struct {
				ok, afterCommit int
				last            error
			}
			out := make(chan result, 1)
			started := make(chan struct{})
			go func() {
				var r result
				for i := 0; i < 5000; i++ {
					if i == 5 {
						close(started)
					}
					// Read before the write starts: a write that began before
					// Commit returned may still succeed after it (it then
					// committed, which the count below checks); one that began
					// after must fail.
					afterCommit := committed.Load()
					_, err := htx.Exec(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ('k', 'bg')`)
					if err != nil {
						r.last = err
						break
					}
					r.ok++
					if afterCommit {
						r.afterCommit++
					}
				}
				out <- r
			}()
			<-started
			if err := commit(); err != nil {
				t.Fatalf("Commit: %v", err)
			}
			committed.Store(true)
			r := <-out
			if !errors.Is(r.last, pgx.ErrTxClosed) {
				t.Fatalf("the left-behind goroutine's writes ended with %v after %d successes, want pgx.ErrTxClosed", r.last, r.ok)
			}
			if r.afterCommit != 0 {
				t.Errorf("%d writes begun after Commit returned succeeded", r.afterCommit)
			}
			if n := app.ordersFor(t, "k", "bg"); n != r.ok {
				t.Errorf("%d orders committed, %d writes succeeded: want them equal", n, r.ok)
			}
		})
	}
}
