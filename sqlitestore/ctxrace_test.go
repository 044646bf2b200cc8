package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// A transaction's context that ends while Commit or Rollback runs (the store's
// own rollback on the context's end, context.AfterFunc, races the caller's
// COMMIT) leaves a consistent outcome — Commit returns nil exactly when the
// order committed — and hands every connection back to the pool outside any
// transaction: afterwards, on a pool of two connections, plain writes commit
// and transactions begin, many times over, in BeginTx and BeginLocked alike.
func TestContextEndRacesCommit(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	db.SetMaxOpenConns(2)
	createOrders(t, db)
	s := newStore(t, db)
	type committer interface {
		Commit(context.Context) error
		Rollback(context.Context) error
	}
	begin := map[string]func(ctx context.Context, i int) (context.Context, committer, error){
		"BeginTx": func(ctx context.Context, _ int) (context.Context, committer, error) {
			return s.BeginTx(ctx)
		},
		"BeginLocked": func(ctx context.Context, i int) (context.Context, committer, error) {
			tctx, tx, rec, err := s.BeginLocked(ctx, "", fmt.Sprintf("ctx-race-%d", i), time.Now())
			if err == nil && rec != nil {
				err = errors.New("BeginLocked found a record")
			}
			return tctx, tx, err
		},
	}
	for name, begin := range begin {
		committed := 0
		for i := range 60 {
			ctx, cancel := context.WithCancel(context.Background())
			tctx, tx, err := begin(ctx, i)
			if err != nil {
				t.Fatalf("%s %d: begin: %v", name, i, err)
			}
			if _, err := sqlitestore.Tx(tctx).ExecContext(context.Background(), `INSERT INTO orders (item) VALUES ('race')`); err != nil {
				t.Fatalf("%s %d: insert: %v", name, i, err)
			}
			start := make(chan struct{})
			var wg sync.WaitGroup
			var commitErr error
			wg.Go(func() {
				<-start
				commitErr = tx.Commit(context.Background())
			})
			wg.Go(func() {
				<-start
				if i%3 != 0 { // every third round: the context ends after the commit
					cancel()
				}
			})
			close(start)
			wg.Wait()
			cancel()
			if err := tx.Rollback(context.Background()); err != nil {
				t.Fatalf("%s %d: Rollback after Commit: %v", name, i, err)
			}
			if commitErr == nil {
				committed++
			}
			if n := countOrdersItem(t, db, "race"); n != committed {
				t.Fatalf("%s %d: %d orders committed, but Commit returned nil %d times (last: %v)", name, i, n, committed, commitErr)
			}
		}
		t.Logf("%s: %d of 60 commits went through", name, committed)
		// Every connection is back outside a transaction: autocommit writes
		// on both connections are visible, and transactions begin.
		for i := range 20 {
			if _, err := db.Exec(`INSERT INTO orders (item) VALUES ('after')`); err != nil {
				t.Fatalf("%s: plain insert %d: %v", name, i, err)
			}
			ctx, tx, err := s.BeginTx(context.Background())
			if err != nil {
				t.Fatalf("%s: BeginTx %d after the races: %v", name, i, err)
			}
			if _, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders (item) VALUES ('after')`); err != nil {
				t.Fatalf("%s: insert in transaction %d: %v", name, i, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("%s: Commit %d after the races: %v", name, i, err)
			}
		}
		if n := countOrdersItem(t, db, "after"); n != 40 {
			t.Fatalf("%s: %d orders after the races, want 40 (a connection stayed in a transaction)", name, n)
		}
		if _, err := db.Exec(`DELETE FROM orders`); err != nil {
			t.Fatal(err)
		}
	}
}

func countOrdersItem(t testing.TB, db *sql.DB, item string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders WHERE item = ?`, item).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A Commit called after the transaction's context ended commits nothing, as
// with database/sql's own context handling (whose Commit checks the context
// first): the store's rollback on the context's end must not lose a race
// against a Commit that comes right after the end.
func TestCommitAfterContextEndCommitsNothing(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	s := newStore(t, db)
	for i := range 200 {
		ctx, cancel := context.WithCancel(context.Background())
		var tctx context.Context
		var tx interface {
			Commit(context.Context) error
			Rollback(context.Context) error
		}
		var err error
		if i%2 == 0 {
			tctx, tx, err = s.BeginTx(ctx)
		} else {
			var rec *idem.Record
			tctx, tx, rec, err = s.BeginLocked(ctx, "", fmt.Sprintf("after-end-%d", i), time.Now())
			if err == nil && rec != nil {
				err = errors.New("BeginLocked found a record")
			}
		}
		if err != nil {
			t.Fatalf("round %d: begin: %v", i, err)
		}
		if _, err := sqlitestore.Tx(tctx).ExecContext(context.Background(), `INSERT INTO orders (item) VALUES ('late')`); err != nil {
			t.Fatalf("round %d: insert: %v", i, err)
		}
		cancel()
		err = tx.Commit(context.Background())
		_ = tx.Rollback(context.Background())
		if n := countOrdersItem(t, db, "late"); n != 0 || err == nil {
			t.Fatalf("round %d: Commit after the context ended = %v, %d orders committed; want an error and none", i, err, n)
		}
	}
}
