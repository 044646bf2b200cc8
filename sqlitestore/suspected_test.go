package sqlitestore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// TestMarkOutcomeUnknownSingleTx: in the single-transaction flow too, a
// handler that cannot know its outcome leaves the key in flight: its answer
// goes to the client but is neither committed nor replayed; retries get 409
// until the lease lapses, then (LapsedRefuse) 503 outcome-unknown. It used to
// commit the answer as the outcome and replay it.
func TestMarkOutcomeUnknownSingleTx(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := newStore(t, db)
	var mu sync.Mutex
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	mw, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx, NowFunc: clock, LapsedLease: idem.LapsedRefuse, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), "CREATE TABLE IF NOT EXISTS unknown_rows (x)"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		idem.MarkOutcomeUnknown(r.Context())
		w.WriteHeader(http.StatusAccepted)
	})))
	t.Cleanup(srv.Close)
	if a := send(t, srv.URL, "u", "{}"); a.status != http.StatusAccepted {
		t.Fatalf("first: %+v, want the handler's 202", a)
	}
	if a := send(t, srv.URL, "u", "{}"); a.status != http.StatusConflict || a.code != idem.CodeKeyInUse {
		t.Fatalf("retry within the lease: %+v, want 409 %s (the outcome is unknown, not the 202)", a, idem.CodeKeyInUse)
	}
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	if a := send(t, srv.URL, "u", "{}"); a.status != http.StatusServiceUnavailable || a.code != idem.CodeOutcomeUnknown {
		t.Fatalf("retry after the lease: %+v, want 503 %s", a, idem.CodeOutcomeUnknown)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	var tables int
	if err := db.QueryRow("SELECT count(*) FROM sqlite_master WHERE name = 'unknown_rows'").Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("the handler's transaction committed (%d, %v), want it rolled back", tables, err)
	}
}

// duplicateStore completes a duplicate of the first claim it is asked for
// just before making it: a request with the same key that ran and committed
// 201 in the window between an aborted single transaction's rollback and its
// claimAndKeep.
type duplicateStore struct {
	*sqlitestore.Store
	once sync.Once
}

func (s *duplicateStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	s.once.Do(func() {
		dup := req
		dup.Token = "duplicate"
		if _, ok, err := s.Store.Claim(ctx, dup); err != nil || !ok {
			panic(fmt.Sprintf("the duplicate's claim: %v %v", ok, err))
		}
		if err := s.Store.Complete(ctx, req.Scope, req.Key, "duplicate", &idem.Response{Status: 201, Body: []byte("duplicate's 201")}, req.Now, req.ExpiresAt); err != nil {
			panic(err)
		}
	})
	return s.Store.Claim(ctx, req)
}

// TestAbortedAnswerYieldsToACommittedDuplicate: a single transaction aborts
// (SQLite refuses its COMMIT; the handler answered 409). Its answer is kept with a
// claim outside the transaction, after the rollback freed the lock; when a
// duplicate committed 201 in that window, the client hears the record's 201
// (replayed), not a 409 that contradicts what every retry will hear.
func TestAbortedAnswerYieldsToACommittedDuplicate(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	s := &duplicateStore{Store: newStore(t, db)}
	mw, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		t.Fatal(err)
	}
	for _, ddl := range []string{
		"CREATE TABLE dup_parents (id INTEGER PRIMARY KEY)",
		"CREATE TABLE dup_children (parent INTEGER NOT NULL REFERENCES dup_parents(id) DEFERRABLE INITIALLY DEFERRED)",
	} {
		if _, err := db.Exec(ddl); err != nil {
			t.Fatal(err)
		}
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// SQLite refuses the COMMIT (a deferred foreign key): ErrTxAborted, and
		// the handler's 409 is kept outside the transaction.
		if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO dup_children VALUES (7)"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusConflict)
	})))
	t.Cleanup(srv.Close)
	a := send(t, srv.URL, "dup", "{}")
	if a.status != http.StatusCreated || !a.replayed {
		t.Fatalf("answer %+v, want the duplicate's 201 replayed", a)
	}
	if b := send(t, srv.URL, "dup", "{}"); b.status != http.StatusCreated || !b.replayed {
		t.Fatalf("retry %+v, want the duplicate's 201 replayed", b)
	}
}
