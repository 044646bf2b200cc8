package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

var _ idem.SingleTxStore = (*sqlitestore.Store)(nil)

func TestBeginLocked(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	s := newStore(t, db)
	ctx := context.Background()
	now := time.Now()
	complete := func(key string, created time.Time, ttl time.Duration) *idem.Record {
		return &idem.Record{Key: key, State: idem.StateComplete, Fingerprint: "v1:x", Token: "tok",
			CreatedAt: created, LeaseUntil: created, ExpiresAt: created.Add(ttl),
			Response: &idem.Response{Status: 201, Header: http.Header{"Location": {"/orders/1"}}, Body: []byte("done")}}
	}

	// Absent: nothing is read, the handler's write and the record commit together.
	tctx, tx, rec, err := s.BeginLocked(ctx, "", "a", now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked(absent) = %+v, %v; want no record", rec, err)
	}
	if sqlitestore.Tx(tctx) == nil {
		t.Fatal("the context of BeginLocked carries no transaction")
	}
	// The key is in flight in this store: a second BeginLocked is refused at once.
	if _, _, _, err := s.BeginLocked(ctx, "", "a", now); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("second BeginLocked = %v, want ErrInFlight", err)
	}
	if _, err := sqlitestore.Tx(tctx).ExecContext(tctx, `INSERT INTO orders (item) VALUES ('a')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Insert(tctx, complete("a", now, time.Hour)); err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if err := tx.Commit(tctx); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(tctx); err != nil {
		t.Errorf("Rollback after Commit = %v, want nil", err)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want 1", got)
	}

	// Complete: BeginLocked returns it; the caller rolls back.
	_, tx, rec, err = s.BeginLocked(ctx, "", "a", now)
	if err != nil || rec == nil || rec.State != idem.StateComplete || string(rec.Response.Body) != "done" || rec.Response.Header.Get("Location") != "/orders/1" {
		t.Fatalf("BeginLocked(complete) = %+v, %v; want the complete record", rec, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// Rolled back: nothing stays, and the key is free again.
	tctx, tx, _, err = s.BeginLocked(ctx, "", "b", now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlitestore.Tx(tctx).ExecContext(tctx, `INSERT INTO orders (item) VALUES ('b')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "", "b", now); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Get after Rollback = %v, want ErrNotFound", err)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders after a rollback, want 1", got)
	}

	// Expired: counted as absent, and replaced whole by Insert.
	_, tx, _, err = s.BeginLocked(ctx, "", "c", now)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Insert(ctx, complete("c", now, time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Minute)
	_, tx, rec, err = s.BeginLocked(ctx, "", "c", later)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked(expired) = %+v, %v; want no record", rec, err)
	}
	fresh := complete("c", later, time.Hour)
	fresh.Fingerprint = "v1:new"
	if err := tx.Insert(ctx, fresh); err != nil {
		t.Fatalf("Insert over an expired record: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get(ctx, "", "c", later)
	if err != nil || got.Fingerprint != "v1:new" || !got.CreatedAt.Equal(later) {
		t.Fatalf("record after replacing the expired one = %+v, %v", got, err)
	}

	// Insert never overwrites a record that is live at BeginLocked's clock reading
	// (the middleware does not call it then; the store checks all the same).
	_, tx, _, err = s.BeginLocked(ctx, "", "d", now)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Insert(ctx, complete("d", now, time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	_, tx, rec, err = s.BeginLocked(ctx, "", "d", now)
	if err != nil || rec == nil {
		t.Fatalf("BeginLocked(live) = %+v, %v; want the live record", rec, err)
	}
	if err := tx.Insert(ctx, complete("d", now, time.Hour)); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("Insert over a live record = %v, want ErrInFlight", err)
	}
	_ = tx.Rollback(ctx)
}

// A transaction ends with the context it was begun with (the handler's, which
// ends at HandlerTimeout): its writes are rolled back and nothing commits, in
// BeginTx and in BeginLocked alike. The store arranges that rollback itself,
// since it gives database/sql a context that cannot end.
func TestTransactionEndsWithItsContext(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	s := newStore(t, db)
	begin := map[string]func(ctx context.Context) (context.Context, interface{ Commit(context.Context) error }, error){
		"BeginTx": func(ctx context.Context) (context.Context, interface{ Commit(context.Context) error }, error) {
			return s.BeginTx(ctx)
		},
		"BeginLocked": func(ctx context.Context) (context.Context, interface{ Commit(context.Context) error }, error) {
			tctx, tx, rec, err := s.BeginLocked(ctx, "", "ends-with-ctx", time.Now())
			if err == nil && rec != nil {
				err = errors.New("BeginLocked found a record")
			}
			return tctx, tx, err
		},
	}
	for name, begin := range begin {
		ctx, cancel := context.WithCancel(context.Background())
		tctx, tx, err := begin(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := sqlitestore.Tx(tctx).ExecContext(context.Background(), `INSERT INTO orders (item) VALUES ('lamp')`); err != nil {
			t.Fatalf("%s: insert: %v", name, err)
		}
		cancel()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			_, err := sqlitestore.Tx(tctx).ExecContext(context.Background(), `SELECT 1`)
			if errors.Is(err, sql.ErrTxDone) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the transaction is still open 5 s after its context ended (%v)", name, err)
			}
		}
		if err := tx.Commit(context.Background()); err == nil {
			t.Fatalf("%s: Commit after the context ended succeeded", name)
		}
		if n := countOrders(t, db); n != 0 {
			t.Fatalf("%s: %d orders committed, want 0", name, n)
		}
	}
}
