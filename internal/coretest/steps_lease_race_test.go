package idem_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepTakeoverRacesRunningStep: execution A is inside its step when its
// lease lapses (the clock jumps two leases), and B takes the key over and
// reaches the same step while A's call is still under way, on PostgreSQL
// in claim-then-complete (SQLite's handler transaction holds the file's write
// lock while A runs, so no takeover can claim; the single-transaction flow
// holds the key with its transaction's lock, which no clock lapses). With
// OnUnknown(StepRefuse) — a provider that honours no key — B is refused and
// the provider sees exactly one call; with StepRerun B calls again with the
// very same derived key. A's late outcome is not recorded over B's (its
// FinishStep is fenced), and in the end exactly one execution's answer is
// stored.
func TestStepTakeoverRacesRunningStep(t *testing.T) {
	for _, policy := range []idem.UnknownPolicy{idem.StepRefuse, idem.StepRerun} {
		t.Run(policy.String(), func(t *testing.T) {
			func(store idem.Store, flow idem.Flow) {
				clk := &stepClock{now: time.Now()}
				mw, err := idem.New(store, &idem.Config{NowFunc: clk.Now, Flow: flow, Lease: 10 * time.Second, KeepFunc: func(s int) bool { return s < 500 }})
				if err != nil {
					t.Fatal(err)
				}
				var mu sync.Mutex
				var keys []string
				entered := make(chan struct{}, 2)
				releaseA := make(chan struct{})
				first := true
				errs := make(chan error, 2)
				srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					id, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) {
						mu.Lock()
						keys = append(keys, key)
						isA := first
						first = false
						mu.Unlock()
						entered <- struct{}{}
						if isA {
							<-releaseA
						}
						return "ch_" + key[5:13], nil
					}, idem.OnUnknown(policy))
					errs <- err
					switch {
					case errors.Is(err, idem.ErrStepUnknown):
						http.Error(w, err.Error(), http.StatusServiceUnavailable)
					case err != nil:
						http.Error(w, err.Error(), http.StatusBadGateway)
					default:
						w.WriteHeader(http.StatusCreated)
						_, _ = w.Write([]byte(id))
					}
				})))
				key := "race-" + policy.String()
				aDone := make(chan answer, 1)
				go func() { aDone <- postAnswer(t, srv, key) }()
				<-entered
				clk.Add(25 * time.Second) // A's lease lapses while its call is under way
				b := postAnswer(t, srv, key)
				close(releaseA)
				a := <-aDone
				mu.Lock()
				defer mu.Unlock()
				if policy == idem.StepRefuse {
					if len(keys) != 1 || b.status != http.StatusServiceUnavailable {
						t.Fatalf("refuse: B got %d %s; provider calls %d; want B refused (503) and one call", b.status, b.body, len(keys))
					}
				} else if len(keys) != 2 || keys[0] != keys[1] || b.status != http.StatusCreated {
					t.Fatalf("rerun: B got %d %s; provider keys %v; want 201 and a second call with the same key", b.status, b.body, keys)
				}
				if a.status == http.StatusCreated {
					t.Fatalf("A, whose lease was taken over, got 201 %s; its step's outcome must not be recorded over B's", a.body)
				}
				// What is stored now is B's outcome (rerun) or nothing final
				// yet (refuse: unknown, in flight): never A's.
				if policy == idem.StepRerun {
					if c := postAnswer(t, srv, key); c.status != http.StatusCreated || string(c.body) != string(b.body) {
						t.Fatalf("after the race the key answers %d %s, want B's 201 %s", c.status, c.body, b.body)
					}
				}
			}(newPGStore(t), idem.FlowClaimComplete)
		})
	}
}
