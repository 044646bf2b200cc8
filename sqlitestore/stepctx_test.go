package sqlitestore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// TestStepFenceWithForeignTx: BeginStep with Holder reads the request record
// through the transaction its context carries only when that is an open
// transaction of a Store on the same *sql.DB; a context carrying the Store's
// own transaction after it ended, another Store's transaction on another
// *sql.DB, or another Store's (another table's) on the same *sql.DB gets the
// fence all the same: the holder's step begins, another owner's is refused,
// and nothing waits (a pool of one connection on each database). Guard: it
// passed when written.
func TestStepFenceWithForeignTx(t *testing.T) {
	t.Parallel()
	db1, db2 := openDB(t), openDB(t)
	db1.SetMaxOpenConns(1)
	db2.SetMaxOpenConns(1)
	a, b, c := newStore(t, db1), newStore(t, db1), newStore(t, db2)
	now := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, claimed, err := a.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("claim: claimed %v, %v", claimed, err)
	}
	ended := func() (context.Context, func()) {
		tctx, tx, err := a.BeginTx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		return tctx, func() {}
	}
	open := func(s interface {
		BeginTx(context.Context) (context.Context, idem.Tx, error)
	}) func() (context.Context, func()) {
		return func() (context.Context, func()) {
			tctx, tx, err := s.BeginTx(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return tctx, func() { _ = tx.Rollback(ctx) }
		}
	}
	for i, c := range []struct {
		name string
		ctx  func() (context.Context, func())
	}{
		{"other store's tx on the same db", open(b)}, // first: the steps file is found through it
		{"own ended tx", ended},
		{"tx on another db", open(c)},
	} {
		t.Run(c.name, func(t *testing.T) {
			tctx, end := c.ctx()
			defer end()
			req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: fmt.Sprintf("n%d", i), Owner: "tok", Holder: true,
				DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}
			if _, began, err := a.BeginStep(tctx, req); err != nil || !began {
				t.Fatalf("holder's BeginStep: began %v, %v", began, err)
			}
			req.Name, req.Owner = req.Name+"-other", "other"
			if _, began, err := a.BeginStep(tctx, req); !errors.Is(err, idem.ErrLockLost) {
				t.Fatalf("another owner's BeginStep: began %v, %v; want ErrLockLost", began, err)
			}
		})
	}
}

// TestStepAfterHandlerEndedTx: a step whose handler committed or rolled back
// the request's transaction itself (sqlitestore.Tx, which idem ends) fails
// with an error that says so and what to do; before, it said only that the
// records' database file could not be found ("transaction has already been
// committed or rolled back").
func TestStepAfterHandlerEndedTx(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := newStore(t, db)
	now := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, claimed, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("claim: claimed %v, %v", claimed, err)
	}
	tctx, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := sqlitestore.Tx(tctx).Rollback(); err != nil {
		t.Fatal(err)
	}
	req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: "charge", Owner: "tok", Holder: true,
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}
	_, began, err := s.BeginStep(tctx, req)
	if err == nil || began {
		t.Fatalf("BeginStep after the handler rolled back idem's transaction: began %v, %v; want an error", began, err)
	}
	if !strings.Contains(err.Error(), "never call Commit or Rollback") {
		t.Fatalf("BeginStep after the handler rolled back idem's transaction: %v; want it to say not to end the transaction", err)
	}
}
