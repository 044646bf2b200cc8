package idem_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepOutlivesLease: a step's call takes 2.5 leases; the lease is renewed
// meanwhile, so a retry sent while the call runs is told the request is in
// flight (409) instead of taking the key over and calling again, and the
// step's outcome is recorded under the renewed claim. On PostgreSQL, in both
// flows, over loopback HTTP with the real clock.
func TestStepOutlivesLease(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			store := newPGStore(t)
			lease := 600 * time.Millisecond
			mw, err := idem.New(store, &idem.Config{Flow: flow, Lease: lease})
			if err != nil {
				t.Fatal(err)
			}
			var calls atomic.Int32
			inStep := make(chan struct{}, 2)
			srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				id, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) {
					calls.Add(1)
					inStep <- struct{}{}
					time.Sleep(lease * 5 / 2)
					return "ch_" + key[5:13], nil
				})
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(id))
			})))
			key := "renew-" + flow.String()
			first := make(chan answer, 1)
			go func() { first <- postAnswer(t, srv, key) }()
			<-inStep
			time.Sleep(lease * 3 / 2) // past the first lease: only renewal keeps the key
			if b := postAnswer(t, srv, key); b.status != http.StatusConflict {
				t.Errorf("a retry while the step runs past its first lease: %d %s, want 409", b.status, b.body)
			}
			a := <-first
			if a.status != http.StatusCreated || calls.Load() != 1 {
				t.Fatalf("the first request: %d %s, provider calls %d; want 201 and one call", a.status, a.body, calls.Load())
			}
			if c := postAnswer(t, srv, key); c.status != http.StatusCreated || string(c.body) != string(a.body) || calls.Load() != 1 {
				t.Fatalf("the retry after: %d %s, calls %d; want the replayed 201", c.status, c.body, calls.Load())
			}
		})
	}
}
