package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/expirytest"
)

// TestExpiryBoundary runs expirytest.Boundary on PostgreSQL in both flows: a
// complete record reaching ExpiresAt while duplicates on servers 1 ms apart and
// janitors race for it.
func TestExpiryBoundary(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 12)
			expirytest.Boundary(t, func(t *testing.T) idem.Store { return db.newStore(t) }, f.flow)
		})
	}
}

// TestReplayReaderHoldsNoLock: in the single-transaction flow a request that
// finds the record live (it will replay it) must not hold the key's lock, or a
// request whose clock has just passed the record's expiry — for which the key
// is free — hears 409 idempotency_key_in_use although nothing runs (found by
// TestExpiryBoundary: requests straddling the expiry instant got 409, and none
// ran the operation). A BeginLocked that found the live record is held open
// while a request at ExpiresAt arrives: it runs the operation (it got 409
// before).
func TestReplayReaderHoldsNoLock(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 6)
	store := db.newStore(t)
	const ttl = time.Hour
	t0 := time.Now().Add(-ttl)
	expires := t0.Add(ttl)
	runs := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "exec %d", runs)
	})
	serve := func(now time.Time) string {
		mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx, TTL: ttl, NowFunc: func() time.Time { return now }})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		t.Cleanup(srv.Close)
		return srv.URL + "/orders"
	}
	key, body := "reader-"+randomHex(6), []byte(`{}`)
	if a := post(serve(t0), key, body); a.err != nil || a.status != http.StatusCreated {
		t.Fatalf("first = %d %s %v", a.status, a.body, a.err)
	}
	ctx := context.Background()
	_, tx, rec, err := store.BeginLocked(ctx, "", key, expires.Add(-time.Millisecond))
	if err != nil || rec == nil || rec.State != idem.StateComplete {
		t.Fatalf("BeginLocked just before the expiry = %+v, %v; want the live record", rec, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	a := post(serve(expires), key, body)
	if a.err != nil || a.status != http.StatusCreated || a.replayed || string(a.body) != "exec 2" {
		t.Fatalf("at ExpiresAt, while a replay only reads the key: %d %s (err %v); want the operation run again", a.status, a.body, a.err)
	}
}
