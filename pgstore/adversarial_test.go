package pgstore_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestCommitCutMidway: the connection dies after the completion and COMMIT were
// sent, while the completion waits for a row lock. Commit must report the
// outcome as unknown (no sentinel the middleware would act on as "nothing
// committed"): when the lock is released, PostgreSQL executes the COMMIT it
// already received, and the record and the order do commit.
func TestCommitCutMidway(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	app := newOrderApp(t, db)
	u, err := url.Parse(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := faults.Listen(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	u.Host = proxy.Addr()
	cut, err := pgxpool.New(ctx30(t), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer cut.Close()
	s, err := pgstore.New(cut, &pgstore.Config{Table: unquote(app.store.Table())})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:f", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	ctx, tx, err := s.BeginTx(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var pid int
	if err := pgstore.Tx(ctx).QueryRow(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ('k', 'cut') RETURNING pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	locker, err := db.pool.Begin(ctx30(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(context.Background()) }()
	if _, err := locker.Exec(ctx30(t), `SELECT 1 FROM `+app.store.Table()+` WHERE key = 'k' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx30(t), "s", "k", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- tx.Commit(ctx30(t)) }()
	for deadline := time.Now().Add(20 * time.Second); db.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the completion never waited for the row lock")
		}
	}
	proxy.Cut()
	err = <-done
	if err == nil || errors.Is(err, idem.ErrTxAborted) || errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Commit cut midway = %v; want an error that is neither ErrTxAborted nor ErrLockLost", err)
	}
	if !strings.Contains(err.Error(), "may or may not have committed") {
		t.Errorf("Commit cut midway = %v; want it to say the outcome is unknown", err)
	}
	if err := locker.Commit(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	// The server may still execute the COMMIT it received, or may have dropped
	// it with the connection: either way, both or neither of the order and the
	// completion commit.
	// The record and the orders are read in one statement, so with one snapshot:
	// read one after the other, the COMMIT could land in between.
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var state, orders int
		if err := db.pool.QueryRow(ctx30(t), `SELECT (SELECT state FROM `+app.store.Table()+` WHERE scope = 's'::bytea AND key = 'k'::bytea),
			(SELECT count(*) FROM `+app.orders+` WHERE idem_key = 'k' AND tag = 'cut')`).Scan(&state, &orders); err != nil {
			t.Fatal(err)
		}
		rec := &idem.Record{State: idem.State(state)}
		if rec.State == idem.StateComplete {
			if orders != 1 {
				t.Fatalf("record complete but %d orders: the transaction committed partly", orders)
			}
			t.Log("the cut commit did commit")
			return
		}
		if orders != 0 {
			t.Fatalf("record in flight but %d orders: the transaction committed partly", orders)
		}
		if time.Now().After(deadline) {
			t.Log("the cut commit did not commit")
			return
		}
	}
}

// TestHandlerEndsTransaction: what a handler does to the request's transaction
// itself, in the claim-then-complete flow.
func TestHandlerEndsTransaction(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		act  func(ctx context.Context, tx pgx.Tx) error
		// want is Commit's error; orders is how many orders commit; complete
		// whether the record ends complete.
		want     error
		orders   int
		complete bool
	}{
		{"Commit is refused and the work commits with the completion", func(ctx context.Context, tx pgx.Tx) error {
			if err := tx.Commit(ctx); err == nil || !strings.Contains(err.Error(), "do not call Commit") {
				return errors.New("tx.Commit did not refuse: " + errString(err))
			}
			return nil
		}, nil, 1, true},
		{"Rollback", func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) }, idem.ErrTxAborted, 0, false},
		{"ROLLBACK as SQL", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "ROLLBACK"); return err }, idem.ErrTxAborted, 0, false},
		{"COMMIT as SQL", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "COMMIT"); return err }, nil, 1, true},
		{"savepoint rolled back after a failed statement", func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, "SELECT 1/0"); err == nil {
				return errors.New("1/0 succeeded")
			}
			return sp.Rollback(ctx)
		}, nil, 1, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 2)
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
			if err := c.act(ctx, htx); err != nil {
				t.Fatal(err)
			}
			if err = tx.Complete(ctx30(t), "s", "k", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour)); err == nil {
				err = tx.Commit(ctx30(t))
			}
			_ = tx.Rollback(ctx30(t))
			if !errors.Is(err, c.want) || (c.want == nil && err != nil) {
				t.Fatalf("Commit = %v, want %v", err, c.want)
			}
			if n := app.ordersFor(t, "k", ""); n != c.orders {
				t.Errorf("%d orders committed, want %d", n, c.orders)
			}
			rec, err := app.store.Get(ctx30(t), "s", "k", now)
			if err != nil || (rec.State == idem.StateComplete) != c.complete {
				t.Errorf("record = %+v, %v; want complete=%v", rec, err, c.complete)
			}
			assertPoolClean(t, db)
		})
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
