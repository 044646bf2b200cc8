package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// ctxKeepingStore is a memstore that keeps the context of each Claim and
// notes what it saw during the call.
type ctxKeepingStore struct {
	*memstore.Store
	ctx         context.Context
	errDuring   error
	deadline    time.Time
	hasDeadline bool
	value       any
	doneDuring  bool
	askDone     bool // look at Done during the call
}

type ctxTestKey struct{}

func (s *ctxKeepingStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	s.ctx, s.errDuring, s.value = ctx, ctx.Err(), ctx.Value(ctxTestKey{})
	s.deadline, s.hasDeadline = ctx.Deadline()
	if s.askDone {
		select {
		case <-ctx.Done():
			s.doneDuring = true
		default:
		}
	}
	return s.Store.Claim(ctx, req)
}

// TestClaimContext: the context a store's Claim gets carries the request's
// values, not its cancellation, ends max(Lease, CleanupTimeout) from the claim,
// and is cancelled once the claim returned, as context.WithTimeout's was —
// whether or not the store asked for Done.
func TestClaimContext(t *testing.T) {
	t.Parallel()
	for _, askDone := range []bool{false, true} {
		store := &ctxKeepingStore{Store: memstore.New(nil), askDone: askDone}
		t.Cleanup(func() { _ = store.Close() })
		mw, err := idem.New(store, &idem.Config{Lease: 40 * time.Second, CleanupTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
		reqCtx, cancel := context.WithCancel(context.WithValue(context.Background(), ctxTestKey{}, "v"))
		cancel() // the client went away before the claim: the claim runs all the same
		r := httptest.NewRequestWithContext(reqCtx, http.MethodPost, "/orders", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", "k")
		start := time.Now()
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			t.Fatalf("status %d, want 201", w.Code)
		}
		if store.errDuring != nil || store.doneDuring {
			t.Errorf("askDone %v: during the claim Err %v, Done closed %v; want a live context although the client left", askDone, store.errDuring, store.doneDuring)
		}
		if store.value != "v" {
			t.Errorf("askDone %v: Value %v; want the request's value", askDone, store.value)
		}
		if want := start.Add(40 * time.Second); !store.hasDeadline || store.deadline.Before(want.Add(-time.Second)) || store.deadline.After(want.Add(time.Second)) {
			t.Errorf("askDone %v: deadline %v (%v); want about %v", askDone, store.deadline, store.hasDeadline, want)
		}
		if err := store.ctx.Err(); err != context.Canceled {
			t.Errorf("askDone %v: after the claim Err %v; want context.Canceled", askDone, err)
		}
		select {
		case <-store.ctx.Done():
		case <-time.After(5 * time.Second):
			t.Errorf("askDone %v: Done not closed after the claim returned", askDone)
		}
	}
}
