package mysqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// TestCommitAfterContextEndCommitsNothing runs testCommitAfterContextEndCommitsNothing
// with and without multiStatements (see bothModes).
func TestCommitAfterContextEndCommitsNothing(t *testing.T) {
	bothModes(t, testCommitAfterContextEndCommitsNothing)
}

// A Commit called after the transaction's context ended commits nothing, in
// BeginTx and BeginLocked alike: database/sql rolls the transaction back on
// the context's end from a goroutine of its own, and a COMMIT sent right after
// the end (with multiStatements, inside the store's last batch, which
// database/sql's own Commit check does not see) must not win that race. This
// is what keeps a handler that ran past HandlerTimeout from committing.
func testCommitAfterContextEndCommitsNothing(t *testing.T) {
	db := openDB(t, 4, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	for i := range 60 {
		ctx, cancel := context.WithCancel(ctxFor(t))
		var tctx context.Context
		var tx interface {
			Commit(context.Context) error
			Rollback(context.Context) error
		}
		var err error
		now := time.Now()
		locked := i%2 == 1
		if !locked {
			tctx, tx, err = s.BeginTx(ctx)
		} else {
			var ltx idem.LockedTx
			var rec *idem.Record
			tctx, ltx, rec, err = s.BeginLocked(ctx, "", fmt.Sprintf("after-end-%d", i), now)
			if err == nil && rec != nil {
				err = errors.New("BeginLocked found a record")
			}
			tx = ltx
			if err == nil {
				err = ltx.Insert(context.Background(), &idem.Record{
					Scope: "", Key: fmt.Sprintf("after-end-%d", i), State: idem.StateComplete, Fingerprint: "v1:x",
					CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour),
					Response: &idem.Response{Status: 201, Body: []byte("late")},
				})
			}
		}
		if err != nil {
			cancel()
			t.Fatalf("round %d: begin: %v", i, err)
		}
		if _, err := mysqlstore.Tx(tctx).ExecContext(context.Background(), "INSERT INTO `"+orders+"` (item) VALUES ('late')"); err != nil {
			cancel()
			t.Fatalf("round %d: insert: %v", i, err)
		}
		cancel()
		err = tx.Commit(context.Background())
		_ = tx.Rollback(context.Background())
		if n := countOrders(t, db, orders, "late"); n != 0 || err == nil {
			t.Fatalf("round %d (locked %v): Commit after the context ended = %v, %d orders committed; want an error and none", i, locked, err, n)
		}
		if locked {
			if rec, err := s.Get(ctxFor(t), "", fmt.Sprintf("after-end-%d", i), now); !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("round %d: the record after a Commit that failed: %+v, %v; want none", i, rec, err)
			}
		}
	}
}
